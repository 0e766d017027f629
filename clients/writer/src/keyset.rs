//! Keyset bounds sought on the server (`key_bound`): how a chunked snapshot of a composite or
//! text key is planned and how a reconcile on such a key cuts its buckets. Only the source
//! compares key values (its collation decides that `'north'` and `'North'` are one value),
//! so the writer never orders them itself: it hands the bounds the server returned back to it.

use mssql_cdc_proto::client::CdcClient;
use mssql_cdc_proto::keys::{KeySeek, KeyTuple};
use mssql_cdc_proto::protocol::KeyBoundAnswer;
use serde_json::json;

use crate::error::Result;

/// The key columns `keys` of `table` a walk seeks on.
#[derive(Clone, Copy)]
pub struct Keyset<'a> {
    /// The Flight server.
    pub client: &'a CdcClient,
    /// `schema.table`.
    pub table: &'a str,
    /// The columns, in key order.
    pub keys: &'a [String],
    /// Whether they are the unique index (every key value is one row).
    pub unique: bool,
}

impl Keyset<'_> {
    /// The key of the `(n + 1)`-th row of a range, sought by the server.
    pub async fn seek(&self, seek: KeySeek) -> Result<Option<KeyTuple>> {
        let mut body = serde_json::to_value(&seek).unwrap_or_default();
        body["table"] = json!(self.table);
        body["keys"] = json!(self.keys);
        let answer: KeyBoundAnswer = self.client.action("key_bound", &body).await?;
        Ok(answer.bound)
    }

    /// Bounds about `rows` rows apart from the first key up to `to` (inclusive; `None`: the
    /// last key), sought by the server ([`mssql_cdc_proto::keys::walk`]).
    pub async fn walk(&self, to: Option<&KeyTuple>, rows: u64) -> Result<Vec<KeyTuple>> {
        mssql_cdc_proto::keys::walk(|seek| self.seek(seek), (self.unique, to), rows, None).await
    }
}
