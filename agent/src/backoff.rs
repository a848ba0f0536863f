//! Capped exponential backoff with jitter, for reconnecting after a fault.
//!
//! The delay starts at 250 ms and doubles per consecutive failure up to `max`. Each delay is
//! drawn uniformly from [d/2, d] ("equal jitter"): half of it is guaranteed, so a flapping
//! node is not hammered, and the random half keeps several agents that lost the same primary
//! from reconnecting in lock-step. A good cycle resets the sequence.

use std::time::Duration;

/// The first delay after a fault.
pub const INITIAL: Duration = Duration::from_millis(250);

#[derive(Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    /// Consecutive failures since the last reset.
    attempt: u32,
    rng: fastrand::Rng,
}

impl Backoff {
    pub fn new(max: Duration) -> Self {
        Self::with_rng(INITIAL, max, fastrand::Rng::new())
    }

    /// A backoff with a chosen first delay and random source (tests seed it).
    pub fn with_rng(initial: Duration, max: Duration, rng: fastrand::Rng) -> Self {
        // A max below the first delay would make the sequence grow from a cap: clamp instead.
        let initial = initial.min(max);
        Backoff {
            initial,
            max,
            attempt: 0,
            rng,
        }
    }

    /// The un-jittered delay for the current attempt: initial * 2^attempt, capped.
    pub fn ceiling(&self) -> Duration {
        // 2^20 * 250 ms is already days: stop doubling there so the shift cannot overflow.
        let factor = 1u32 << self.attempt.min(20);
        self.initial.saturating_mul(factor).min(self.max)
    }

    /// The delay to wait before the next try; advances the sequence.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self.ceiling();
        self.attempt = self.attempt.saturating_add(1);
        let ceiling_ns = ceiling.as_nanos().min(u64::MAX as u128) as u64;
        let half = ceiling_ns / 2;
        Duration::from_nanos(half + self.rng.u64(0..=ceiling_ns - half))
    }

    /// Back to the first delay, after a good cycle.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// Consecutive failures so far.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeded(max: Duration) -> Backoff {
        Backoff::with_rng(INITIAL, max, fastrand::Rng::with_seed(7))
    }

    #[test]
    fn doubles_up_to_the_cap() {
        let mut b = seeded(Duration::from_secs(2));
        let ceilings: Vec<u128> = (0..7)
            .map(|_| {
                let c = b.ceiling().as_millis();
                b.next_delay();
                c
            })
            .collect();
        assert_eq!(ceilings, vec![250, 500, 1000, 2000, 2000, 2000, 2000]);
    }

    #[test]
    fn jitter_stays_within_half_and_full_ceiling() {
        let mut b = seeded(Duration::from_secs(30));
        for _ in 0..200 {
            let ceiling = b.ceiling();
            let d = b.next_delay();
            assert!(d <= ceiling, "{d:?} > {ceiling:?}");
            assert!(d >= ceiling / 2, "{d:?} < half of {ceiling:?}");
            assert!(d <= Duration::from_secs(30));
        }
    }

    #[test]
    fn jitter_actually_varies() {
        let mut b = seeded(Duration::from_secs(30));
        for _ in 0..10 {
            b.next_delay();
        }
        let draws: std::collections::HashSet<Duration> = (0..20).map(|_| b.next_delay()).collect();
        assert!(draws.len() > 1, "delays at the cap should not all be equal");
    }

    #[test]
    fn reset_returns_to_first_delay() {
        let mut b = seeded(Duration::from_secs(30));
        for _ in 0..5 {
            b.next_delay();
        }
        assert_eq!(b.attempts(), 5);
        b.reset();
        assert_eq!(b.attempts(), 0);
        assert_eq!(b.ceiling(), INITIAL);
        assert!(b.next_delay() <= INITIAL);
    }

    #[test]
    fn max_below_initial_is_the_cap() {
        let mut b = seeded(Duration::from_millis(100));
        for _ in 0..5 {
            assert!(b.next_delay() <= Duration::from_millis(100));
        }
    }

    #[test]
    fn many_failures_do_not_overflow() {
        let mut b = seeded(Duration::from_secs(30));
        for _ in 0..10_000 {
            b.next_delay();
        }
        assert_eq!(b.ceiling(), Duration::from_secs(30));
    }
}
