//! A transaction of the simulated database: each method is one statement with its own
//! `__$command_id`; its operations take the seqvals of the transaction's log block, and the
//! commit publishes them under one commit LSN (`SimWriter::commit`).

use rand::Rng;

use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::source::TableName;

use super::{Change, KeyUpdateStyle, SimWriter, TableRows};
use crate::sim::storage::content_in;

/// A transaction in progress: each method is one statement (one `__$command_id`).
pub struct Transaction<'w> {
    pub(super) writer: &'w mut SimWriter,
    pub(super) changes: Vec<Change>,
    pub(super) operations: u32,
    pub(super) command_id: i32,
}

impl Transaction<'_> {
    fn rows(&mut self, table: &TableName) -> Result<&mut TableRows> {
        self.writer
            .tables
            .get_mut(table)
            .ok_or_else(|| Error::TableNotFound {
                table: table.to_string(),
            })
    }

    fn push(&mut self, table: &TableName, operation: i32, seq: u32, key: i64, content: u64) {
        self.changes.push(Change {
            table: table.clone(),
            operation,
            // Slot inside the transaction's block; made absolute at commit.
            seqval: Lsn::from_u128(u128::from(seq)).expect("small"),
            command_id: self.command_id,
            key,
            content,
        });
    }

    fn next_operation(&mut self) -> u32 {
        self.operations += 1;
        self.operations
    }

    /// `INSERT` of `count` new rows; returns their keys.
    pub fn insert(&mut self, table: &TableName, count: usize) -> Result<Vec<i64>> {
        self.command_id += 1;
        let mut keys = Vec::with_capacity(count);
        for _ in 0..count {
            let key = *self
                .writer
                .next_keys
                .get(table)
                .ok_or_else(|| Error::TableNotFound {
                    table: table.to_string(),
                })?;
            self.writer.next_keys.insert(table.clone(), key + 1);
            let random = self.writer.rng.random::<u64>();
            let rows = self.rows(table)?;
            let content = content_in(rows.generation, random);
            rows.insert(key, content);
            let seq = self.next_operation();
            self.push(table, 2, seq, key, content);
            keys.push(key);
        }
        Ok(keys)
    }

    /// `UPDATE` of these rows (operations 3 and 4 sharing a seqval); unknown keys are skipped.
    pub fn update(&mut self, table: &TableName, keys: &[i64]) -> Result<usize> {
        self.command_id += 1;
        let mut updated = 0;
        for &key in keys {
            let Some(old) = self.rows(table)?.get(key) else {
                continue;
            };
            let random = self.writer.rng.random::<u64>();
            let rows = self.rows(table)?;
            let new = content_in(rows.generation, random);
            rows.set(key, new);
            let seq = self.next_operation();
            self.push(table, 3, seq, key, old);
            self.push(table, 4, seq, key, new);
            updated += 1;
        }
        Ok(updated)
    }

    /// `DELETE` of these rows (operation 1 with the deleted values); unknown keys are skipped.
    pub fn delete(&mut self, table: &TableName, keys: &[i64]) -> Result<usize> {
        self.command_id += 1;
        let mut deleted = 0;
        for &key in keys {
            let Some(old) = self.rows(table)?.remove(key) else {
                continue;
            };
            let seq = self.next_operation();
            self.push(table, 1, seq, key, old);
            deleted += 1;
        }
        Ok(deleted)
    }

    /// `UPDATE ... SET <key> = new_key` of one row, recorded in `style`; the row keeps its
    /// other values. Fails when `old_key` is absent or `new_key` taken.
    pub fn update_key(
        &mut self,
        table: &TableName,
        old_key: i64,
        new_key: i64,
        style: KeyUpdateStyle,
    ) -> Result<()> {
        self.command_id += 1;
        let rows = self.rows(table)?;
        if rows.get(new_key).is_some() {
            return Err(Error::invalid(format!(
                "{table}: key {new_key} already exists"
            )));
        }
        let content = rows
            .remove(old_key)
            .ok_or_else(|| Error::invalid(format!("{table}: no row with key {old_key}")))?;
        rows.insert(new_key, content);
        let next_key = self.writer.next_keys.entry(table.clone()).or_insert(1);
        *next_key = (*next_key).max(new_key + 1);
        match style {
            KeyUpdateStyle::DeleteInsert => {
                let delete_seq = self.next_operation();
                self.push(table, 1, delete_seq, old_key, content);
                let insert_seq = self.next_operation();
                self.push(table, 2, insert_seq, new_key, content);
            }
            KeyUpdateStyle::InPlace => {
                let seq = self.next_operation();
                self.push(table, 3, seq, old_key, content);
                self.push(table, 4, seq, new_key, content);
            }
        }
        Ok(())
    }

    /// Up to `count` distinct random existing keys.
    pub fn random_keys(&mut self, table: &TableName, count: usize) -> Result<Vec<i64>> {
        let writer = &mut *self.writer;
        let rows = writer
            .tables
            .get(table)
            .ok_or_else(|| Error::TableNotFound {
                table: table.to_string(),
            })?;
        let available = rows.keys.len();
        let mut picked = Vec::with_capacity(count.min(available));
        let mut seen = std::collections::HashSet::new();
        let mut attempts = 0;
        while picked.len() < count.min(available) && attempts < count * 4 + 16 {
            attempts += 1;
            let key = rows.keys[writer.rng.random_range(0..available)];
            if seen.insert(key) {
                picked.push(key);
            }
        }
        Ok(picked)
    }

    /// Up to `count` distinct random existing keys among the newest `share` (0 to 1) of the
    /// key range: the rows an orders table's updates favour.
    pub fn random_recent_keys(
        &mut self,
        table: &TableName,
        count: usize,
        share: f64,
    ) -> Result<Vec<i64>> {
        let next = self.next_key(table);
        let writer = &mut *self.writer;
        let rows = writer
            .tables
            .get(table)
            .ok_or_else(|| Error::TableNotFound {
                table: table.to_string(),
            })?;
        let span = ((rows.keys.len() as f64 * share.clamp(0.0, 1.0)) as i64).max(1);
        let low = (next - span).max(1);
        let mut picked = Vec::with_capacity(count);
        let mut seen = std::collections::HashSet::new();
        let mut attempts = 0;
        while picked.len() < count && attempts < count * 8 + 16 && low < next {
            attempts += 1;
            let key = writer.rng.random_range(low..next);
            if rows.index.contains_key(&key) && seen.insert(key) {
                picked.push(key);
            }
        }
        Ok(picked)
    }

    /// The next key an insert into `table` would take.
    pub fn next_key(&self, table: &TableName) -> i64 {
        self.writer.next_keys.get(table).copied().unwrap_or(1)
    }

    /// Change rows so far.
    pub fn change_count(&self) -> usize {
        self.changes.len()
    }

    /// Commits: returns the commit LSN, or `None` when the transaction changed nothing (SQL
    /// Server records no commit for it).
    pub fn commit(self) -> Result<Option<Lsn>> {
        let Transaction {
            writer,
            changes,
            operations,
            ..
        } = self;
        writer.commit(changes, operations)
    }
}
