//! Each principal's share of the source's connections.
//!
//! On SQL Server a `do_get` stream holds a pooled connection, and its query's locks, for as
//! long as its read lasts, and a planning call holds one while it runs. Without a share, one
//! principal reading slowly could hold every connection of the pool: every other caller, and
//! the health probe, would then wait for the pool's checkout timeout. So a principal's
//! streams and planning calls together run at most `share` source reads at once; one more
//! waits for a place in its principal's share, as it would have waited for a connection, but
//! in its principal's line instead of everyone's:
//!
//! - a stream waits before its read starts, at most the pool's checkout timeout (as long as it
//!   would have waited for a connection), then ends with `RESOURCE_EXHAUSTED` and a retry
//!   hint; its permit is held by the stream's producer and given back when the source read
//!   ends (also when the stall timeout ends it), not when the client finally drops the
//!   response;
//! - a planning call waits at most the call deadline, then is refused the same way;
//!   `wait_for_commits` takes a place for each of its source reads, not for its wait.
//!
//! The default share is the pool's size less one (`--source-share`): whatever one principal
//! does, the others and the health probe keep a connection. Callers of a server without
//! authentication share one share. A source without a pool (the simulator) has no share.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};

/// The retry hint of a stream refused for its principal's share.
const RETRY_AFTER_SECONDS: u64 = 2;

/// Source reads each principal may run at once.
#[derive(Debug)]
pub struct SourceShare {
    share: Option<usize>,
    by_principal: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// One running source read's place in its principal's share; dropping it gives it back.
#[derive(Debug)]
pub struct SharePermit {
    _permit: Option<OwnedSemaphorePermit>,
}

impl SourceShare {
    /// `share` source reads per principal at once (`None`: no bound).
    pub fn new(share: Option<usize>) -> Arc<Self> {
        Arc::new(SourceShare {
            share,
            by_principal: Mutex::new(HashMap::new()),
        })
    }

    /// The share of a source whose pool holds `pool_size` connections, unless `configured`
    /// says otherwise (0: no bound): the pool less one, so that one connection always stays
    /// for the others.
    pub fn of_pool(configured: Option<usize>, pool_size: Option<usize>) -> Option<usize> {
        match configured {
            Some(0) => None,
            Some(share) => Some(share),
            None => pool_size.map(|size| size.saturating_sub(1).max(1)),
        }
    }

    /// The bound per principal, if any.
    pub fn share(&self) -> Option<usize> {
        self.share
    }

    /// A permit for one more source read of `principal` once its share has room: at most
    /// `within` (then `Busy`), or as long as the caller waits when `None`.
    pub fn wait(
        &self,
        principal: Option<&str>,
        within: Option<Duration>,
    ) -> impl Future<Output = Result<SharePermit>> + Send + 'static {
        let semaphore = self.semaphore(principal);
        let (who, share) = (who(principal), self.share.unwrap_or_default());
        async move {
            let Some(semaphore) = semaphore else {
                return Ok(SharePermit { _permit: None });
            };
            let acquired = semaphore.acquire_owned();
            // The semaphore is never closed, so a permit is all it can give.
            let permit = match within {
                None => acquired.await.ok(),
                Some(within) => tokio::time::timeout(within, acquired)
                    .await
                    .map_err(|_| Error::Busy {
                        what: format!(
                            "{who} runs {share} source reads at once, its share of the \
                             source's connections (--source-share), and none ended within {} s",
                            within.as_secs_f64()
                        ),
                        retry_after_seconds: RETRY_AFTER_SECONDS,
                    })?
                    .ok(),
            };
            Ok(SharePermit { _permit: permit })
        }
    }

    fn semaphore(&self, principal: Option<&str>) -> Option<Arc<Semaphore>> {
        let share = self.share?;
        // Entries are per principal name, bounded by the tokens file (anonymous callers: one).
        let mut by_principal = self
            .by_principal
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let semaphore = by_principal
            .entry(principal.unwrap_or_default().to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(share)));
        Some(Arc::clone(semaphore))
    }
}

fn who(principal: Option<&str>) -> String {
    match principal {
        Some(name) => format!("principal '{name}'"),
        None => "the anonymous caller".into(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_default_share_leaves_one_connection_of_the_pool() {
        assert_eq!(SourceShare::of_pool(None, Some(8)), Some(7));
        assert_eq!(SourceShare::of_pool(None, Some(1)), Some(1));
        assert_eq!(SourceShare::of_pool(None, None), None, "no pool, no share");
        assert_eq!(SourceShare::of_pool(Some(3), Some(8)), Some(3));
        assert_eq!(SourceShare::of_pool(Some(0), Some(8)), None, "0: no bound");
    }

    #[tokio::test]
    async fn a_principal_runs_at_most_its_share_and_others_keep_theirs() {
        let share = SourceShare::new(Some(2));
        let soon = Some(Duration::from_millis(50));
        let first = share.wait(Some("a"), soon).await.expect("first");
        let _second = share.wait(Some("a"), soon).await.expect("second");
        let refused = share.wait(Some("a"), soon).await.expect_err("a's third");
        assert!(matches!(refused, Error::Busy { .. }));
        assert!(
            refused
                .to_string()
                .contains("principal 'a' runs 2 source reads")
                && refused.to_string().contains("--source-share"),
            "{refused}"
        );
        let _other = share
            .wait(Some("b"), soon)
            .await
            .expect("b has its own share");
        let waiting = tokio::spawn(share.wait(Some("a"), None));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "a's third read waits for its share");
        drop(first);
        let _third = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a permit given back is taken by the waiting read")
            .expect("joined")
            .expect("a permit");
        let anonymous = share.wait(None, soon).await.expect("the anonymous share");
        let _more = share.wait(None, soon).await.expect("two");
        assert!(
            share.wait(None, soon).await.is_err(),
            "anonymous callers share one"
        );
        drop(anonymous);
        let unbounded = SourceShare::new(None);
        let mut many = Vec::new();
        for _ in 0..100 {
            many.push(unbounded.wait(Some("a"), soon).await.expect("no bound"));
        }
        assert_eq!(many.len(), 100);
    }
}
