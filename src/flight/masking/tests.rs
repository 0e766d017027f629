use std::sync::Arc;

use arrow::array::{Array, AsArray, BinaryArray, Int32Array, Int64Array, StringArray};
use arrow::datatypes::{DataType, Field, Schema};
use arrow::record_batch::RecordBatch;

use super::*;
use crate::types::{Length, SqlType};

const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

fn policy(json: serde_json::Value) -> Result<MaskPolicy> {
    MaskPolicy::parse(json.to_string().as_bytes(), |_| Ok(KEY.to_vec()))
}

fn customers() -> TableName {
    "dbo.customers".parse().expect("name")
}

fn column(name: &str, sql_type: SqlType) -> OutputColumn {
    OutputColumn {
        name: name.into(),
        sql_type,
    }
}

fn hmac_hex(text: &str) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, KEY);
    hex::encode(hmac::sign(&key, text.as_bytes()).as_ref())
}

#[test]
fn a_masks_file_is_checked_whole() {
    let good = serde_json::json!({
        "hash_key_file": "mask.key",
        "tables": {"dbo.Customers": {"Email": "hash", "name": "truncate(2)"}},
    });
    let masks = policy(good).expect("good");
    let anonymous = Principal::anonymous();
    // Names ignore case on both sides.
    assert_eq!(
        masks.mask_of(&anonymous, &customers(), "EMAIL"),
        Some(Mask::Hash)
    );
    assert_eq!(masks.mask_of(&anonymous, &customers(), "segment"), None);
    for (bad, why) in [
        (
            serde_json::json!({"tables": {"dbo.customers": {"email": "hash"}}}),
            "no hash_key_file",
        ),
        (
            serde_json::json!({"tables": {"dbo.customers": {"email": "sha1"}}}),
            "not a mask",
        ),
        (
            serde_json::json!({"tables": {"dbo.customers": {"email": "null"}}, "extra": 1}),
            "unknown field",
        ),
        (
            serde_json::json!({"tables": {"dbo.customers": {"email": "null"},
                "DBO.CUSTOMERS": {"name": "null"}}}),
            "twice",
        ),
    ] {
        let error = policy(bad).expect_err(why).to_string();
        assert!(error.contains(why), "{why}: {error}");
    }
    // A name given twice word for word: JSON maps keep the last silently, which would serve
    // the first entry's column clear.
    for text in [
        r#"{"tables": {"dbo.customers": {"email": "hash"}, "dbo.customers": {"name": "null"}}}"#,
        r#"{"tables": {"dbo.customers": {"email": "null", "email": "truncate(2)"}}}"#,
    ] {
        let error = MaskPolicy::parse(text.as_bytes(), |_| Ok(KEY.to_vec()))
            .expect_err("a name twice")
            .to_string();
        assert!(error.contains("twice"), "{error}");
    }
    let short = MaskPolicy::parse(br#"{"hash_key_file": "k", "tables": {}}"#, |_| {
        Ok(b"short\n".to_vec())
    });
    assert!(
        short
            .expect_err("short key")
            .to_string()
            .contains("32 bytes")
    );
}

#[test]
fn a_clear_grant_is_the_only_way_to_the_clear_form() {
    let masks =
        policy(serde_json::json!({"tables": {"dbo.customers": {"email": "null"}}})).expect("masks");
    let tokens = serde_json::json!({"principals": [
        {"name": "clear", "tables": ["*"], "clear": ["dbo.cust*"],
         "token_sha256": hex::encode(crate::flight::auth::sha256(b"clear-token-of-the-test"))},
        {"name": "masked", "tables": ["*"],
         "token_sha256": hex::encode(crate::flight::auth::sha256(b"masked-token-of-the-test"))},
    ]});
    let authenticator = super::super::auth::Authenticator::from_json(tokens.to_string().as_bytes())
        .expect("tokens");
    let principal = |token: &str| authenticator.by_token(token).expect("known");
    let clear = principal("clear-token-of-the-test");
    let masked = principal("masked-token-of-the-test");
    let columns = [column("email", SqlType::NVarChar(Length::Limited(200)))];
    let served = |who: &Principal| masks.served(who, &customers(), &columns).expect("served");
    assert!(served(&clear).is_clear());
    assert!(!served(&masked).is_clear());
    assert!(!served(&Principal::anonymous()).is_clear());
    // A ticket planned for the clear principal is not the masked one's, and back.
    let clear_ticket = served(&clear).ticket_columns(&columns);
    let masked_ticket = served(&masked).ticket_columns(&columns);
    assert_eq!(masked_ticket[0].mask, "null");
    let refused = served(&masked)
        .check_ticket(&clear_ticket)
        .expect_err("clear");
    assert!(matches!(refused, Error::TicketMasksChanged(_)), "{refused}");
    served(&clear)
        .check_ticket(&masked_ticket)
        .expect_err("masked");
    served(&masked).check_ticket(&masked_ticket).expect("own");
    // Calls that need the values in clear.
    let error = masks
        .refuse_masked(&masked, &customers(), ["customer_id", "Email"], "cut on it")
        .expect_err("masked key");
    assert!(error.to_string().contains("dbo.customers.Email"), "{error}");
    masks
        .refuse_masked(&clear, &customers(), ["email"], "cut on it")
        .expect("clear grant");
}

#[test]
fn masked_batches_hash_truncate_and_null_under_their_schema() {
    let masks = policy(serde_json::json!({
        "hash_key_file": "mask.key",
        "tables": {"dbo.customers": {
            "email": "hash", "id32": "hash", "name": "truncate(2)", "blob": "truncate(1)",
            "id64": "null",
        }},
    }))
    .expect("masks");
    let columns = [
        column("email", SqlType::NVarChar(Length::Limited(200))),
        column("id32", SqlType::Int),
        column("name", SqlType::NVarChar(Length::Max)),
        column("blob", SqlType::VarBinary(Length::Max)),
        column("id64", SqlType::BigInt),
        column("kept", SqlType::BigInt),
    ];
    let served = masks
        .served(&Principal::anonymous(), &customers(), &columns)
        .expect("served");
    let schema = Arc::new(Schema::new(vec![
        Field::new("_meta", DataType::Utf8, false),
        Field::new("email", DataType::Utf8, true),
        Field::new("id32", DataType::Int32, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("blob", DataType::Binary, true),
        Field::new("id64", DataType::Int64, true),
        Field::new("kept", DataType::Int64, true),
    ]));
    let masked_schema = served.schema(Arc::clone(&schema), 1);
    let email = masked_schema.field(1);
    assert_eq!(
        email.metadata().get(MASK_METADATA_KEY).map(String::as_str),
        Some("hash")
    );
    assert_eq!(masked_schema.field(2).data_type(), &DataType::Utf8);
    assert_eq!(
        masked_schema
            .field(2)
            .metadata()
            .get(SQL_TYPE_METADATA_KEY)
            .map(String::as_str),
        Some("char(64)")
    );
    assert!(masked_schema.field(6).metadata().is_empty());
    let batch = RecordBatch::try_new(
        schema,
        vec![
            Arc::new(StringArray::from(vec!["m", "m", "m"])),
            Arc::new(StringArray::from(vec![
                Some("a@x.org"),
                None,
                Some("a@x.org"),
            ])),
            Arc::new(Int32Array::from(vec![Some(42), Some(-7), None])),
            Arc::new(StringArray::from(vec![Some("éèx"), Some("a"), None])),
            Arc::new(BinaryArray::from(vec![
                Some(&b"\x01\x02"[..]),
                None,
                Some(&b""[..]),
            ])),
            Arc::new(Int64Array::from(vec![1, 2, 3])),
            Arc::new(Int64Array::from(vec![4, 5, 6])),
        ],
    )
    .expect("batch");
    let masked = served.apply(batch, 1, &masked_schema).expect("masked");
    let email = masked.column(1).as_string::<i32>();
    assert_eq!(email.value(0), hmac_hex("a@x.org"));
    assert_eq!(email.value(0), email.value(2), "equal values hash equal");
    assert!(email.is_null(1), "NULL stays NULL");
    // An integer hashes its decimal text, so a join with an int64 copy still matches.
    let id32 = masked.column(2).as_string::<i32>();
    assert_eq!(id32.value(0), hmac_hex("42"));
    assert_eq!(id32.value(1), hmac_hex("-7"));
    let name = masked.column(3).as_string::<i32>();
    assert_eq!(
        (name.value(0), name.value(1)),
        ("éè", "a"),
        "characters, not bytes"
    );
    let blob = masked.column(4).as_binary::<i32>();
    assert_eq!((blob.value(0), blob.value(2)), (&b"\x01"[..], &b""[..]));
    assert_eq!(masked.column(5).null_count(), 3);
    assert_eq!(
        masked.column(6).as_ref(),
        &Int64Array::from(vec![4, 5, 6]) as &dyn Array
    );
}

#[test]
fn a_mask_that_does_not_fit_its_column_is_refused_at_the_plan() {
    let masks =
        policy(serde_json::json!({"tables": {"dbo.customers": {"segment": "truncate(1)"}}}))
            .expect("masks");
    let error = masks
        .served(
            &Principal::anonymous(),
            &customers(),
            &[column("segment", SqlType::TinyInt)],
        )
        .expect_err("truncated number");
    assert!(
        error.to_string().contains("dbo.customers.segment"),
        "{error}"
    );
}

#[test]
fn a_masked_read_is_cut_on_served_sizes_only() {
    let schema = Arc::new(Schema::new(vec![Field::new("v", DataType::Utf8, true)]));
    let batch = |values: &[&str]| {
        RecordBatch::try_new(
            Arc::clone(&schema),
            vec![Arc::new(StringArray::from(values.to_vec()))],
        )
        .expect("batch")
    };
    let rows = |batches: &[RecordBatch]| {
        batches
            .iter()
            .map(RecordBatch::num_rows)
            .collect::<Vec<_>>()
    };
    // Each row is 4 bytes of offset and its text: a bound of 10 bytes ends a batch at the
    // row that reaches it, wherever the source's batches ended.
    let cut = |source: &[&[&str]]| {
        let mut recut = Recut::new(Arc::clone(&schema), 100, 10);
        let mut out = Vec::new();
        for values in source {
            out.extend(recut.push(&batch(values)).expect("push"));
        }
        out.extend(recut.finish().expect("finish"));
        out
    };
    let one = cut(&[&["ab", "cdef", "g", "hi", "j"]]);
    let other = cut(&[&["ab"], &["cdef", "g"], &[], &["hi", "j"]]);
    assert_eq!(rows(&one), [2, 2, 1]);
    assert_eq!(rows(&other), rows(&one));
    assert_eq!(one, other, "the same rows, the same batches");
    // The row bound alone, too.
    let mut recut = Recut::new(Arc::clone(&schema), 2, usize::MAX);
    let done = recut.push(&batch(&["a", "b", "c"])).expect("push");
    assert_eq!(rows(&done), [2]);
    assert_eq!(
        recut.finish().expect("finish").map(|b| b.num_rows()),
        Some(1)
    );
    assert!(recut.finish().expect("empty").is_none());
}
