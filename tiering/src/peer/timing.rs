//! How long to wait for a member before it is given up on. The configured timeouts are short,
//! so that a dead or stopped member costs a fraction of a second; but on nodes whose cores are
//! saturated, a live member answers late, and failing it over sends its chunks to the next
//! choice, which fetches them from the origin a second time. Three things tell a slow member
//! from a dead one:
//! - answer times, smoothed as TCP's retransmission timer smooths round trips (RFC 6298): the
//!   first-byte timeout stretches to four deviations above the mean;
//! - a timeout backs the timer off (RFC 6298, 5.5), until the next answer is timed;
//! - a member heard from within the timeout (an answer, or a piece of another transfer on its
//!   connection) is alive, and is waited for, window by window, up to the fetch timeout.
//!
//! A stopped member sends nothing, so it still costs at most two windows.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
// Tokio's clock, which tests can pause.
use tokio::time::Instant;

/// The most the timeouts stretch, in multiples of the configured ones.
pub const MAX_STRETCH: u32 = 8;

/// What this node has seen of the members' answers.
#[derive(Debug, Default)]
pub struct Waits {
    answers: Mutex<AnswerTimes>,
    /// When each member was last heard from.
    heard: Mutex<HashMap<String, Instant>>,
}

#[derive(Debug, Clone, Copy)]
struct AnswerTimes {
    mean: f64,
    deviation: f64,
    seen: bool,
    /// The multiple the timer is backed off by, 1 until a timeout.
    backoff: u32,
}

impl Default for AnswerTimes {
    fn default() -> Self {
        AnswerTimes { mean: 0.0, deviation: 0.0, seen: false, backoff: 1 }
    }
}

impl AnswerTimes {
    fn record(&mut self, took: Duration) {
        let t = took.as_secs_f64();
        if self.seen {
            self.deviation = 0.75 * self.deviation + 0.25 * (self.mean - t).abs();
            self.mean = 0.875 * self.mean + 0.125 * t;
        } else {
            (self.mean, self.deviation, self.seen) = (t, t / 2.0, true);
        }
        self.backoff = 1;
    }

    fn timeout(&self, configured: Duration) -> Duration {
        let wanted = Duration::from_secs_f64(self.mean + 4.0 * self.deviation).max(configured);
        (wanted * self.backoff).clamp(configured, configured * MAX_STRETCH)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Waits {
    /// The first-byte timeout now: `configured`, stretched while members answer slowly.
    pub fn first_byte(&self, configured: Duration) -> Duration {
        lock(&self.answers).timeout(configured)
    }

    /// How much slow answers stretch the first-byte timeout now, at least 1, and without the
    /// backoff: the stall and ping timeouts follow it, and a backoff after a stopped member's
    /// timeout must not make the next stopped one take longer to be found out.
    pub fn stretch(&self, configured: Duration) -> f64 {
        let answers = lock(&self.answers);
        let smoothed = AnswerTimes { backoff: 1, ..*answers }.timeout(configured).as_secs_f64();
        (smoothed / configured.as_secs_f64().max(1e-6)).clamp(1.0, MAX_STRETCH as f64)
    }

    /// `member` answered a request after `took`.
    pub fn answered(&self, member: &str, took: Duration) {
        lock(&self.answers).record(took);
        self.heard(member);
    }

    /// Something came from `member`: an answer or a piece of one.
    pub fn heard(&self, member: &str) {
        let mut heard = lock(&self.heard);
        match heard.get_mut(member) {
            Some(at) => *at = Instant::now(),
            None => {
                heard.insert(member.to_owned(), Instant::now());
            }
        }
    }

    /// Whether anything came from `member` since `since`.
    pub fn heard_since(&self, member: &str, since: Instant) -> bool {
        lock(&self.heard).get(member).is_some_and(|at| *at > since)
    }

    fn heard_within(&self, member: &str, window: Duration) -> bool {
        lock(&self.heard).get(member).is_some_and(|at| at.elapsed() <= window)
    }

    /// `fut`, waited for in windows of `window`: past one, only while `member` was heard from
    /// within it, and never past `most` in all. Err is how long it was waited for; a wait
    /// given up backs the first-byte timer off.
    pub async fn wait<F: Future>(
        &self,
        member: &str,
        window: Duration,
        most: Duration,
        fut: F,
    ) -> Result<F::Output, Duration> {
        let start = Instant::now();
        let mut fut = std::pin::pin!(fut);
        loop {
            let left = most.saturating_sub(start.elapsed());
            if let Ok(out) = tokio::time::timeout(window.min(left), &mut fut).await {
                return Ok(out);
            }
            if start.elapsed() >= most || !self.heard_within(member, window) {
                let mut answers = lock(&self.answers);
                answers.backoff = (answers.backoff * 2).min(MAX_STRETCH);
                return Err(start.elapsed());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn the_first_byte_timeout_follows_slow_answers_within_its_bounds() {
        let configured = MS(250);
        let w = Waits::default();
        assert_eq!(w.first_byte(configured), configured, "nothing seen yet");
        for _ in 0..50 {
            w.answered("m", MS(2));
        }
        assert_eq!(w.first_byte(configured), configured, "fast answers never shorten it");
        for ms in [300, 500, 200, 600, 400, 450, 350, 500] {
            w.answered("m", MS(ms));
        }
        let stretched = w.first_byte(configured);
        assert!(stretched > MS(600) && stretched <= configured * MAX_STRETCH, "{stretched:?}");
        for _ in 0..10 {
            w.answered("m", Duration::from_secs(30));
        }
        assert_eq!(w.first_byte(configured), configured * MAX_STRETCH, "and never past its cap");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_member_is_given_up_on_after_one_window_and_backs_the_timer_off() {
        let w = Waits::default();
        let never = std::future::pending::<()>();
        let waited = w.wait("m", MS(250), Duration::from_secs(30), never).await.unwrap_err();
        assert_eq!(waited, MS(250));
        assert_eq!(w.first_byte(MS(250)), MS(500), "the timer doubled");
        assert_eq!(w.stretch(MS(250)), 1.0, "but not the stall and ping timeouts that follow it");
        w.answered("m", MS(1));
        assert_eq!(w.first_byte(MS(250)), MS(250), "and is recomputed from the next answer");
        for _ in 0..10 {
            let _ = w.wait("m2", MS(250), Duration::from_secs(30), std::future::pending::<()>()).await;
        }
        assert_eq!(w.first_byte(MS(250)), MS(250) * MAX_STRETCH, "never past its cap");
    }

    #[tokio::test(start_paused = true)]
    async fn a_member_heard_from_is_waited_for_until_it_goes_quiet_or_the_most() {
        let w = std::sync::Arc::new(Waits::default());
        // Pieces of another transfer come every 100 ms for 2 s, then nothing.
        let talker = w.clone();
        tokio::spawn(async move {
            for _ in 0..20 {
                talker.heard("m");
                tokio::time::sleep(MS(100)).await;
            }
        });
        let answer = async {
            tokio::time::sleep(MS(1500)).await;
            "answer"
        };
        assert_eq!(w.wait("m", MS(250), Duration::from_secs(30), answer).await, Ok("answer"));
        let waited = w.wait("m", MS(250), Duration::from_secs(30), std::future::pending::<()>()).await.unwrap_err();
        assert!(waited > MS(250) && waited <= MS(1000), "quiet from 2 s on, given up within two windows: {waited:?}");
        let busy = w.clone();
        tokio::spawn(async move {
            loop {
                busy.heard("m");
                tokio::time::sleep(MS(100)).await;
            }
        });
        let waited = w.wait("m", MS(250), MS(2000), std::future::pending::<()>()).await.unwrap_err();
        assert_eq!(waited, MS(2000), "never past the most");
    }
}
