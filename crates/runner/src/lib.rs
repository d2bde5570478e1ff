//! The `onepass` runner. Data flows one way through its layers, each importing only from the
//! ones before it (a test checks the `use crate::…` lines against this order):
//!
//! 1. [`io`], [`progress`], [`tb`] — atomic writes, `.npy`, the checkpoint file format, signals,
//!    failpoints; progress bars and log lines; TensorBoard event files;
//! 2. [`spec`] — every TOML table type, `--set`, errors naming file, line and key;
//! 3. [`rows`], [`columns`] — the output schema: the rows the loops write and the tables hold;
//!    what each table and column means;
//! 4. [`plan`], [`budget`] — pure validation of a spec into configs and cells (`--dry-run`
//!    stops here); the memory its cells will take;
//! 5. [`world`] — the only stage that reads data and runs models; the checks that need data;
//! 6. [`settings`] — the cells: passive, active and deployment loops over a pair source;
//! 7. [`results`] — the run directory's parquet tables from the rows;
//! 8. [`report`] — report.md and figures from those tables;
//! 9. [`run`], [`bench`] — `onepass run` end to end; the feature-model benchmark;
//! 10. [`inspect`] — `onepass cells`: what a run directory holds, read back; [`reference`] —
//!     the reference pages the code writes (spec keys, estimators, result columns).
//!
//! This crate is the only place that knows about files, TOML, parquet and the command line;
//! `estimators`, `selection` and `features` know none of them.

pub mod bench;
pub mod budget;
pub mod columns;
pub mod inspect;
pub mod io;
pub mod plan;
pub mod progress;
pub mod reference;
pub mod report;
pub mod results;
pub mod rows;
pub mod run;
pub mod settings;
pub mod spec;
pub mod tb;
pub mod world;

pub use run::{load_plan, run, RunOptions, RunSummary};
