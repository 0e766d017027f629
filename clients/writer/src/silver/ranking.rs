//! The latest image per key: of each key's change rows, the first by `_start_lsn DESC,
//! _command_id DESC NULLS LAST, _seqval DESC NULLS LAST, _operation DESC`.
//!
//! A rebuild streams every row of a snapshot through DataFusion's `ROW_NUMBER() ... = 1`
//! ([`window`]): its sort spills past the query memory. A merge's changes usually fit in
//! memory, and there a window sorts every row for nothing (5.6-5.8 s of a 1,000,000-change
//! call, docs/silver.md): [`latest`] keeps the best row per key in one hash pass as the
//! changes stream in ([`LatestPerKey`]), keys and ranks encoded as Arrow row-format bytes
//! (NULL keys equal, as `PARTITION BY` groups them), holding only the rows that are still
//! the best of their key. A backlog past the query memory goes through the window.

use std::collections::HashMap;

use std::sync::Arc;

use arrow::array::BooleanArray;
use arrow::compute::{SortOptions, cast, filter_record_batch};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;
use arrow::row::{RowConverter, Rows, SortField};
use deltalake::datafusion::prelude::SessionContext;
use tokio_stream::StreamExt;

use crate::error::{Result, WriterError};
use crate::tables::quote_identifier as quote;

/// The query of `source`'s `columns` (silver's and `_operation`), its first row per key.
pub fn window(source: &str, columns: &str, keys: &[String]) -> String {
    let keys = keys
        .iter()
        .map(|key| quote(key))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "SELECT {columns} FROM (SELECT {columns}, ROW_NUMBER() OVER (PARTITION BY {keys} \
         ORDER BY _start_lsn DESC, _command_id DESC NULLS LAST, _seqval DESC NULLS LAST, \
         _operation DESC) AS _rank FROM ({source})) WHERE _rank = 1"
    )
}

/// How [`latest`] ranked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ranked {
    /// In memory, by one hash pass.
    ByHash,
    /// By DataFusion's window: the changes outgrew the query memory.
    ByWindow,
}

/// The first row per key of `source`'s `columns`: ranked by hash when the changes fit in
/// `budget` bytes, by [`window`] when they do not.
pub async fn latest(
    context: &SessionContext,
    source: &str,
    columns: &str,
    keys: &[String],
    budget: usize,
) -> Result<(Vec<RecordBatch>, Ranked)> {
    let mut changes = context
        .sql(&format!(
            "SELECT {columns}, {} FROM ({source})",
            RANK_ONLY_COLUMNS.join(", ")
        ))
        .await?
        .execute_stream()
        .await?;
    let mut ranker = None;
    while let Some(batch) = changes.next().await {
        let batch = batch?;
        let ranker = match &mut ranker {
            Some(ranker) => ranker,
            None => ranker.insert(LatestPerKey::new(&batch.schema(), keys)?),
        };
        ranker.push(batch)?;
        if ranker.bytes() > budget {
            drop(changes);
            tracing::info!(
                budget,
                "the changes outgrow the query memory: ranked by DataFusion's sort, which spills"
            );
            let ranked = context
                .sql(&window(source, columns, keys))
                .await?
                .collect()
                .await?;
            return Ok((ranked, Ranked::ByWindow));
        }
    }
    let ranked = match ranker {
        Some(ranker) => ranker.finish()?,
        None => Vec::new(),
    };
    Ok((ranked, Ranked::ByHash))
}

/// The columns that rank a key's changes, newest first, with how each sorts.
const RANK: [(&str, SortOptions); 4] = [
    (
        "_start_lsn",
        SortOptions {
            descending: true,
            nulls_first: true,
        },
    ),
    (
        "_command_id",
        SortOptions {
            descending: true,
            nulls_first: false,
        },
    ),
    (
        "_seqval",
        SortOptions {
            descending: true,
            nulls_first: false,
        },
    ),
    (
        "_operation",
        SortOptions {
            descending: true,
            nulls_first: true,
        },
    ),
];

/// The plain type of a string or binary view.
fn plain(data_type: &DataType) -> Option<DataType> {
    match data_type {
        DataType::Utf8View => Some(DataType::Utf8),
        DataType::BinaryView => Some(DataType::Binary),
        _ => None,
    }
}

/// `batch` with its string and binary views as plain arrays. The Parquet reader's views
/// point into whole decoded pages, and the rows a ranking keeps would hold every page
/// alive: the 1,700,000 change rows of a 1,000,000-change call to `dbo.orders` held 950 MB
/// as views, 496 MB as strings, and the ranked rows 670 MB against 237 MB.
fn unviewed(batch: RecordBatch) -> Result<RecordBatch> {
    if !batch
        .schema()
        .fields()
        .iter()
        .any(|field| plain(field.data_type()).is_some())
    {
        return Ok(batch);
    }
    let fields: Vec<Field> = batch
        .schema()
        .fields()
        .iter()
        .map(|field| match plain(field.data_type()) {
            Some(data_type) => field.as_ref().clone().with_data_type(data_type),
            None => field.as_ref().clone(),
        })
        .collect();
    let columns = batch
        .columns()
        .iter()
        .map(|column| match plain(column.data_type()) {
            Some(data_type) => cast(column, &data_type),
            None => Ok(column.clone()),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok(RecordBatch::try_new(
        Arc::new(Schema::new(fields)),
        columns,
    )?)
}

/// The columns [`LatestPerKey`] reads beside the ones it returns.
const RANK_ONLY_COLUMNS: [&str; 2] = ["_command_id", "_seqval"];

/// Where a key's best row so far is: a row of the batch being pushed (`batch` = the held
/// batches' count, `row` its row there) or of a held batch.
#[derive(Clone, Copy)]
struct Best {
    batch: u32,
    row: u32,
}

/// The newest row of each key among batches pushed one at a time (they hold `keys` and the
/// [`RANK`] columns). A pushed batch is held with only the rows that are the newest of their
/// key when it comes (an update's before-image goes at once, beside its after-image), and a
/// row a later batch outranks is dropped at the end, so the rows held are about the keys, not
/// the change rows: of a 1,000,000-change call's 1,700,000 change rows, 1,000,000. Of two rows
/// that rank equal, the first stays (only exact duplicates do).
struct LatestPerKey {
    key_columns: Vec<usize>,
    rank_columns: Vec<usize>,
    key_converter: RowConverter,
    rank_converter: RowConverter,
    /// Key bytes → its best row so far.
    best: HashMap<Box<[u8]>, Best, ahash::RandomState>,
    /// The batches held: their rows, their rows' ranks, and which rows are still the best.
    held: Vec<(RecordBatch, Rows, Vec<bool>)>,
    bytes: usize,
}

impl LatestPerKey {
    fn new(schema: &Schema, keys: &[String]) -> Result<Self> {
        let column_index = |name: &str| {
            schema.index_of(name).map_err(|_| {
                WriterError::Internal(format!("the changes to rank have no column {name}"))
            })
        };
        let key_columns = keys
            .iter()
            .map(|key| column_index(key))
            .collect::<Result<Vec<_>>>()?;
        let rank_columns = RANK
            .iter()
            .map(|(name, _)| column_index(name))
            .collect::<Result<Vec<_>>>()?;
        // In the types `push` ranks them in: views read as plain arrays.
        let field = |index: usize| {
            let data_type = schema.field(index).data_type();
            plain(data_type).unwrap_or_else(|| data_type.clone())
        };
        let key_converter = RowConverter::new(
            key_columns
                .iter()
                .map(|index| SortField::new(field(*index)))
                .collect(),
        )?;
        let rank_converter = RowConverter::new(
            rank_columns
                .iter()
                .zip(RANK)
                .map(|(index, (_, options))| SortField::new_with_options(field(*index), options))
                .collect(),
        )?;
        Ok(LatestPerKey {
            key_columns,
            rank_columns,
            key_converter,
            rank_converter,
            best: HashMap::default(),
            held: Vec::new(),
            bytes: 0,
        })
    }

    /// Bytes held: the rows kept and their ranks.
    fn bytes(&self) -> usize {
        self.bytes
    }

    fn encode(converter: &RowConverter, batch: &RecordBatch, columns: &[usize]) -> Result<Rows> {
        let arrays: Vec<_> = columns
            .iter()
            .map(|index| batch.column(*index).clone())
            .collect();
        Ok(converter.convert_columns(&arrays)?)
    }

    /// Ranks `batch`'s rows against the best so far, then holds those that are now best.
    fn push(&mut self, batch: RecordBatch) -> Result<()> {
        let batch = unviewed(batch)?;
        let keys = Self::encode(&self.key_converter, &batch, &self.key_columns)?;
        let ranks = Self::encode(&self.rank_converter, &batch, &self.rank_columns)?;
        let this = u32::try_from(self.held.len())
            .map_err(|_| WriterError::Internal("too many change batches to rank".into()))?;
        let mut best_here = vec![false; batch.num_rows()];
        for (row, key) in keys.iter().enumerate() {
            let challenger = Best {
                batch: this,
                row: row as u32,
            };
            let Some(best) = self.best.get_mut(key.data()) else {
                self.best.insert(Box::from(key.data()), challenger);
                best_here[row] = true;
                continue;
            };
            let (held, held_rank) = if best.batch == this {
                (None, ranks.row(best.row as usize))
            } else {
                let (_, held_ranks, alive) = &mut self.held[best.batch as usize];
                (Some(alive), held_ranks.row(best.row as usize))
            };
            if ranks.row(row) < held_rank {
                match held {
                    Some(alive) => alive[best.row as usize] = false,
                    None => best_here[best.row as usize] = false,
                }
                *best = challenger;
                best_here[row] = true;
            }
        }
        // Hold only the rows that are best now, renumbered.
        let kept = best_here.iter().filter(|best| **best).count();
        let mut kept_ranks = self.rank_converter.empty_rows(kept, 0);
        let kept_rows = (0..batch.num_rows()).filter(|row| best_here[*row]);
        for (renumbered, row) in kept_rows.enumerate() {
            kept_ranks.push(ranks.row(row));
            if let Some(best) = self.best.get_mut(keys.row(row).data()) {
                best.row = renumbered as u32;
            }
        }
        let rows = if kept == batch.num_rows() {
            batch
        } else {
            filter_record_batch(&batch, &BooleanArray::from(best_here))?
        };
        self.bytes += rows.get_array_memory_size() + kept_ranks.size();
        self.held.push((rows, kept_ranks, vec![true; kept]));
        Ok(())
    }

    /// The best row of every key, without the [`RANK_ONLY_COLUMNS`], in the order they came.
    fn finish(self) -> Result<Vec<RecordBatch>> {
        let mut latest = Vec::with_capacity(self.held.len());
        for (rows, ranks, alive) in self.held {
            drop(ranks);
            let rows = if alive.iter().all(|alive| *alive) {
                rows
            } else {
                filter_record_batch(&rows, &BooleanArray::from(alive))?
            };
            if rows.num_rows() == 0 {
                continue;
            }
            let schema = rows.schema();
            let returned: Vec<usize> = (0..schema.fields().len())
                .filter(|index| !RANK_ONLY_COLUMNS.contains(&schema.field(*index).name().as_str()))
                .collect();
            latest.push(rows.project(&returned)?);
        }
        Ok(latest)
    }
}

/// The newest row of each key among `batches`: [`LatestPerKey`] over them.
#[cfg(test)]
fn latest_per_key(batches: &[RecordBatch], keys: &[String]) -> Result<Vec<RecordBatch>> {
    let Some(first) = batches.first() else {
        return Ok(Vec::new());
    };
    let mut ranker = LatestPerKey::new(&first.schema(), keys)?;
    for batch in batches {
        ranker.push(batch.clone())?;
    }
    ranker.finish()
}

#[cfg(test)]
mod tests {
    use arrow::array::{Array, Int32Array, Int64Array, StringArray};
    use deltalake::datafusion::prelude::SessionContext;

    use super::*;

    /// `(region, id, value, _start_lsn, _command_id, _seqval, _operation)`.
    type Change<'a> = (
        Option<&'a str>,
        Option<i64>,
        &'a str,
        &'a str,
        Option<i32>,
        Option<&'a str>,
        i32,
    );

    fn batch(rows: &[Change<'_>]) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("region", DataType::Utf8, true),
            Field::new("id", DataType::Int64, true),
            Field::new("value", DataType::Utf8, true),
            Field::new("_start_lsn", DataType::Utf8, true),
            Field::new("_command_id", DataType::Int32, true),
            Field::new("_seqval", DataType::Utf8, true),
            Field::new("_operation", DataType::Int32, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringArray::from_iter(rows.iter().map(|row| row.0))),
                Arc::new(Int64Array::from_iter(rows.iter().map(|row| row.1))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|row| row.2))),
                Arc::new(StringArray::from_iter_values(rows.iter().map(|row| row.3))),
                Arc::new(Int32Array::from_iter(rows.iter().map(|row| row.4))),
                Arc::new(StringArray::from_iter(rows.iter().map(|row| row.5))),
                Arc::new(Int32Array::from_iter_values(rows.iter().map(|row| row.6))),
            ],
        )
        .expect("batch")
    }

    /// `region|id|value|_operation` of each row, sorted.
    fn lines(batches: &[RecordBatch]) -> Vec<String> {
        let mut lines = Vec::new();
        for batch in batches {
            let text = |name: &str, row: usize| {
                arrow::util::display::array_value_to_string(
                    batch.column_by_name(name).expect("column"),
                    row,
                )
                .expect("text")
            };
            for row in 0..batch.num_rows() {
                lines.push(format!(
                    "{}|{}|{}|{}",
                    text("region", row),
                    text("id", row),
                    text("value", row),
                    text("_operation", row)
                ));
            }
        }
        lines.sort();
        lines
    }

    fn keys() -> Vec<String> {
        vec!["region".to_string(), "id".to_string()]
    }

    #[test]
    fn each_key_keeps_its_newest_change_by_lsn_command_seqval_then_operation() {
        let first = batch(&[
            // By LSN.
            (Some("eu"), Some(1), "old", "0001", Some(1), Some("01"), 2),
            (Some("eu"), Some(1), "new", "0002", Some(1), Some("01"), 4),
            // The same commit: the higher command id, a NULL one last.
            (Some("eu"), Some(2), "cmd 2", "0003", Some(2), Some("01"), 4),
            (Some("eu"), Some(2), "no cmd", "0003", None, Some("09"), 4),
            // The same command: the higher seqval, a NULL one last.
            (Some("us"), Some(1), "seq 2", "0003", Some(1), Some("02"), 4),
            (Some("us"), Some(1), "no seq", "0003", Some(1), None, 2),
        ]);
        let second = batch(&[
            (Some("eu"), Some(2), "cmd 1", "0003", Some(1), Some("05"), 4),
            // The same row of a key update: its 4 outranks its 3.
            (
                Some("us"),
                Some(2),
                "moved away",
                "0004",
                Some(1),
                Some("01"),
                3,
            ),
            (
                Some("us"),
                Some(2),
                "moved in",
                "0004",
                Some(1),
                Some("01"),
                4,
            ),
            // NULL key parts group together, and apart from a non-NULL one.
            (
                None,
                Some(1),
                "null region old",
                "0001",
                Some(1),
                Some("01"),
                2,
            ),
            (
                None,
                Some(1),
                "null region new",
                "0005",
                Some(1),
                Some("01"),
                1,
            ),
            (Some("eu"), None, "null id", "0001", Some(1), Some("01"), 2),
        ]);
        let latest = latest_per_key(&[first, second], &keys()).expect("ranked");
        assert!(latest[0].column_by_name("_command_id").is_none());
        assert!(latest[0].column_by_name("_seqval").is_none());
        assert_eq!(
            lines(&latest),
            vec![
                "eu|1|new|4",
                "eu|2|cmd 2|4",
                "eu||null id|2",
                "us|1|seq 2|4",
                "us|2|moved in|4",
                "|1|null region new|1",
            ]
        );
    }

    #[test]
    fn views_are_read_as_plain_strings_and_binaries() {
        use arrow::array::{BinaryViewArray, StringViewArray};
        let schema = Arc::new(Schema::new(vec![
            Field::new("text", DataType::Utf8View, true),
            Field::new("bytes", DataType::BinaryView, true),
            Field::new("id", DataType::Int64, true),
        ]));
        let batch = RecordBatch::try_new(
            schema,
            vec![
                Arc::new(StringViewArray::from(vec![
                    Some("a long enough string"),
                    None,
                ])),
                Arc::new(BinaryViewArray::from(vec![Some(b"ab".as_slice()), None])),
                Arc::new(Int64Array::from(vec![1, 2])),
            ],
        )
        .expect("batch");
        let plain = unviewed(batch).expect("plain");
        let types: Vec<DataType> = plain
            .schema()
            .fields()
            .iter()
            .map(|field| field.data_type().clone())
            .collect();
        assert_eq!(types, [DataType::Utf8, DataType::Binary, DataType::Int64]);
        let text = plain
            .column(0)
            .as_any()
            .downcast_ref::<StringArray>()
            .expect("text");
        assert_eq!(text.value(0), "a long enough string");
        assert!(text.is_null(1));
    }

    #[test]
    fn no_batches_rank_to_nothing() {
        assert!(latest_per_key(&[], &keys()).expect("ranked").is_empty());
    }

    #[test]
    fn a_batch_is_held_without_the_rows_it_outranks_itself() {
        let update = batch(&[
            (
                Some("eu"),
                Some(1),
                "before",
                "0002",
                Some(1),
                Some("01"),
                3,
            ),
            (Some("eu"), Some(1), "after", "0002", Some(1), Some("01"), 4),
            (Some("eu"), Some(2), "old", "0001", Some(1), Some("01"), 2),
            (Some("eu"), Some(2), "new", "0003", Some(1), Some("01"), 2),
        ]);
        let mut ranker = LatestPerKey::new(&update.schema(), &keys()).expect("ranker");
        ranker.push(update).expect("pushed");
        let held: Vec<&RecordBatch> = ranker.held.iter().map(|(rows, _, _)| rows).collect();
        assert_eq!(
            lines(&held.into_iter().cloned().collect::<Vec<_>>()),
            ["eu|1|after|4", "eu|2|new|2"]
        );
        // A later batch outranks a held row: it is gone from what the ranking returns.
        ranker
            .push(batch(&[(
                Some("eu"),
                Some(1),
                "later",
                "0004",
                Some(1),
                Some("01"),
                1,
            )]))
            .expect("pushed");
        assert_eq!(
            lines(&ranker.finish().expect("ranked")),
            ["eu|1|later|1", "eu|2|new|2"]
        );
    }

    /// The same rows ranked by DataFusion's window, as the rebuild ranks them: random
    /// changes of few keys, many broken only by the later columns.
    #[tokio::test]
    async fn it_picks_what_the_window_picks() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(22);
        let regions = [Some("eu"), Some("us"), None];
        let lsns = ["0001", "0002", "0003"];
        let seqvals = [Some("01"), Some("02"), None];
        let values: Vec<String> = (0..2_000).map(|n| format!("v{n}")).collect();
        let rows: Vec<Change<'_>> = values
            .iter()
            .map(|value| {
                (
                    regions[rng.random_range(0..3)],
                    (rng.random_range(0..4) > 0).then(|| rng.random_range(0..20)),
                    value.as_str(),
                    lsns[rng.random_range(0..3)],
                    (rng.random_range(0..4) > 0).then(|| rng.random_range(0..3)),
                    seqvals[rng.random_range(0..3)],
                    rng.random_range(1..5),
                )
            })
            .collect();
        // No two rows of a key rank equal (the window would pick either).
        let mut seen = std::collections::HashSet::new();
        let rows: Vec<Change<'_>> = rows
            .into_iter()
            .filter(|row| seen.insert((row.0, row.1, row.3, row.4, row.5, row.6)))
            .collect();
        // The rows in 7 batches, so a key's rows are compared across batches.
        let batches: Vec<RecordBatch> = rows.chunks(300).map(batch).collect();
        let context = SessionContext::new();
        let all = arrow::compute::concat_batches(&batches[0].schema(), &batches).expect("rows");
        context.register_batch("changes", all).expect("register");
        let rank = |budget: usize| {
            let context = context.clone();
            async move {
                latest(
                    &context,
                    "SELECT * FROM changes",
                    "region, id, value, _start_lsn, _operation",
                    &keys(),
                    budget,
                )
                .await
                .expect("ranked")
            }
        };
        let (window, by) = rank(0).await;
        assert_eq!(by, Ranked::ByWindow);
        let (hashed, by) = rank(usize::MAX).await;
        assert_eq!(by, Ranked::ByHash);
        // The hash pass over the batches as they are, too.
        let ours = latest_per_key(&batches, &keys()).expect("ranked");
        assert_eq!(lines(&hashed), lines(&window));
        assert_eq!(lines(&ours), lines(&window));
        assert!(window.iter().map(RecordBatch::num_rows).sum::<usize>() > 40);
    }
}
