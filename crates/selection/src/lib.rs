//! Pair-selection strategies as pure functions: `random-pair`, `best-random`, `best-two`,
//! `best-worst`, `best-quantile`, `ucb` (paper Eq. (6)) and uncertainty scores.
//!
//! Placeholder: the runner issue fills this crate. Nothing here is used yet.
