//! The wall clock of an evaluation bucket, carried through checkpoints ([`BucketClock`]).

use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The wall clock of the current evaluation bucket, kept across a kill: a checkpoint writes the
/// seconds the bucket has run so far and a resume goes on from them. The steps between that
/// checkpoint and a kill drop out of this clock as they drop out of the estimator's seconds
/// (read back from the same checkpoint), so a resumed bucket's `other_s` = wall − estimator
/// stays what the steps left over — where a clock restarted at the resume made it negative.
#[derive(Clone, Debug)]
pub(super) struct BucketClock {
    before: f64,
    since: Instant,
}

impl BucketClock {
    pub(super) fn start() -> Self {
        BucketClock { before: 0.0, since: Instant::now() }
    }

    /// Wall seconds of the bucket so far, over every process that ran it.
    pub(super) fn seconds(&self) -> f64 {
        self.before + self.since.elapsed().as_secs_f64()
    }

    /// The bucket's wall seconds; the next bucket starts now.
    pub(super) fn lap(&mut self) -> f64 {
        let s = self.seconds();
        *self = Self::start();
        s
    }
}

impl Serialize for BucketClock {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_f64(self.seconds())
    }
}

impl<'de> Deserialize<'de> for BucketClock {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(BucketClock { before: f64::deserialize(d)?, since: Instant::now() })
    }
}

#[cfg(test)]
mod tests {
    use super::BucketClock;

    #[test]
    fn a_bucket_clock_carries_its_seconds_through_a_checkpoint() {
        // 2.5 s of the bucket ran in the process that wrote the checkpoint
        let mut c = BucketClock::start();
        c.before = 2.5;
        let bytes = postcard::to_stdvec(&c).unwrap();
        let mut back: BucketClock = postcard::from_bytes(&bytes).unwrap();
        let s = back.seconds();
        assert!((2.5..3.5).contains(&s), "the resumed bucket's clock reads {s} s");
        // a lap ends the bucket with those seconds and starts the next one at zero
        let lap = back.lap();
        assert!(lap >= s, "lap {lap} < {s}");
        assert!(back.seconds() < 1.0, "the next bucket starts at {} s", back.seconds());
        // the checkpoint holds the seconds, not a restart: a fresh clock reads ~0
        assert!(BucketClock::start().seconds() < 1.0);
    }
}
