//! The turns of a sidecar's tables at lake work.
//!
//! Every read of a Delta log (delta-kernel's log replay) holds a thread of tokio's blocking
//! pool (512 threads) while it waits for its file reads, which on a local or mounted lake
//! need a thread of the same pool. A thousand tables loading their logs at once fill the
//! pool with waiters, and the sidecar hangs (seen with 1,000 tables: 512 blocked threads,
//! nearly every table before its first commit). So a table takes a slot for each unit of
//! lake work (a batch, a snapshot wave, an apply, a reconcile, an available-now run) and
//! gives it back before it waits for commits. At most `table_slots` units hold the pool,
//! and their reads stay within the server's stream limit (`--max-streams`). No holder
//! waits for another slot: the shared ledger, which batches wait on, takes none.

use std::sync::Arc;

/// The most tables a sidecar lets do lake work at once (`table_slots`).
pub const MAX_TABLE_SLOTS: usize = 128;

/// A sidecar's slots, shared by its tables.
pub type TableSlots = Arc<tokio::sync::Semaphore>;

/// `count` slots.
pub fn table_slots(count: usize) -> TableSlots {
    Arc::new(tokio::sync::Semaphore::new(count))
}

/// A slot of `slots`, held until dropped.
pub async fn slot(slots: &TableSlots) -> tokio::sync::OwnedSemaphorePermit {
    Arc::clone(slots)
        .acquire_owned()
        .await
        .expect("the sidecar's table slots are never closed")
}
