//! The bound on open `do_get` streams, in total and per principal.
//!
//! A stream holds a [`StreamSlot`] from the moment its ticket is accepted until its response
//! is dropped (read to its end, failed, or abandoned by the client). Over either bound the
//! call is refused at once with `RESOURCE_EXHAUSTED` and a retry hint, instead of queueing:
//! the caller (a Spark task, the writer's retry loop) knows best whether to wait.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};

/// The retry hint of a refused stream: about the time a batch of streams takes.
const RETRY_AFTER_SECONDS: u64 = 2;

/// Counts the open streams.
#[derive(Debug)]
pub struct StreamGate {
    max_total: usize,
    max_per_principal: usize,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_principal: HashMap<String, usize>,
}

/// One open stream's place; dropping it frees the place.
#[derive(Debug)]
pub struct StreamSlot {
    gate: Arc<StreamGate>,
    principal: Option<String>,
}

impl StreamGate {
    /// A gate of `max_total` streams, `max_per_principal` of them for one principal.
    pub fn new(max_total: usize, max_per_principal: usize) -> Arc<Self> {
        Arc::new(StreamGate {
            max_total,
            max_per_principal,
            open: Mutex::new(Open::default()),
        })
    }

    /// A place for one more stream of `principal` (`None`: the anonymous caller of a server
    /// without authentication, bound by the total only), or `Busy` when a bound is reached.
    pub fn enter(self: &Arc<Self>, principal: Option<&str>) -> Result<StreamSlot> {
        let mut open = self.lock();
        let mine = principal
            .and_then(|name| open.by_principal.get(name).copied())
            .unwrap_or(0);
        if open.total >= self.max_total {
            return Err(Error::Busy {
                what: format!(
                    "the server has {} streams open, its limit (--max-streams)",
                    self.max_total
                ),
                retry_after_seconds: RETRY_AFTER_SECONDS,
            });
        }
        if let Some(name) = principal
            && mine >= self.max_per_principal
        {
            return Err(Error::Busy {
                what: format!(
                    "principal '{name}' has {mine} streams open, its limit \
                     (--max-streams-per-principal)"
                ),
                retry_after_seconds: RETRY_AFTER_SECONDS,
            });
        }
        open.total += 1;
        super::metrics::streams_active(1.0);
        if let Some(name) = principal {
            *open.by_principal.entry(name.to_string()).or_default() += 1;
        }
        Ok(StreamSlot {
            gate: Arc::clone(self),
            principal: principal.map(str::to_string),
        })
    }

    /// Streams open now.
    pub fn open_streams(&self) -> usize {
        self.lock().total
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        // A panic while holding the lock leaves counts that are still whole numbers.
        self.open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.gate.lock();
        open.total = open.total.saturating_sub(1);
        super::metrics::streams_active(-1.0);
        if let Some(name) = &self.principal
            && let Some(count) = open.by_principal.get_mut(name)
        {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.by_principal.remove(name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_bounds_streams_in_total_and_per_principal_and_frees_on_drop() {
        let gate = StreamGate::new(3, 2);
        let a1 = gate.enter(Some("a")).expect("first");
        let _a2 = gate.enter(Some("a")).expect("second");
        let refused = gate.enter(Some("a")).expect_err("a's third");
        assert!(
            refused.to_string().contains("principal 'a' has 2 streams"),
            "{refused}"
        );
        let _b1 = gate.enter(Some("b")).expect("b");
        let full = gate.enter(Some("c")).expect_err("total");
        assert!(matches!(full, Error::Busy { .. }));
        assert_eq!(gate.open_streams(), 3);
        drop(a1);
        assert_eq!(gate.open_streams(), 2);
        let _a3 = gate
            .enter(Some("a"))
            .expect("a again after a slot was freed");
    }

    #[test]
    fn the_anonymous_caller_is_bound_by_the_total_only() {
        let gate = StreamGate::new(3, 1);
        let slots: Vec<_> = (0..3)
            .map(|_| gate.enter(None).expect("within the total"))
            .collect();
        assert!(gate.enter(None).is_err());
        drop(slots);
        assert_eq!(gate.open_streams(), 0);
    }
}
