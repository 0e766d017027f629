//! Decoding every catalog type and TDS value into Arrow, against hand-built column data.

use std::borrow::Cow;

use arrow::array::{
    Array, BinaryArray, BooleanArray, Date32Array, Decimal128Array, Float64Array, Int16Array,
    Int32Array, StringArray, TimestampMicrosecondArray,
};
use arrow::datatypes::TimeUnit;
use tiberius::numeric::Numeric;
use tiberius::time::{DateTimeOffset, SmallDateTime};
use tiberius::xml::XmlData;
use tiberius::{ColumnType, Row};

use super::*;
use arrow::array::ArrayRef;
use arrow::datatypes::DataType;

/// Decodes `values` into one column of `sql_type`.
fn decode(sql_type: &str, values: Vec<ColumnData<'static>>) -> ArrayRef {
    let data_type = sql_type
        .parse::<SqlType>()
        .expect("type")
        .arrow_type()
        .expect("mapped");
    let mut decoders = vec![ColumnBuilder::new(&data_type, values.len()).expect("decoder")];
    for value in values {
        let row = Row::builder().column("c", ColumnType::Null, value).build();
        append_row(&mut decoders, row).expect("decodes");
    }
    let array = decoders[0].finish();
    assert_eq!(array.data_type(), &data_type);
    array
}

fn downcast<T: 'static>(array: &ArrayRef) -> &T {
    array.as_any().downcast_ref::<T>().expect("array type")
}

fn datetime2(days: u32, increments: u64, scale: u8) -> DateTime2 {
    DateTime2::new(Date::new(days), Time::new(increments, scale))
}

const LAST_DAY: u32 = 3_652_058; // 9999-12-31 in days since 0001-01-01

#[test]
fn integers_widen_and_tinyint_is_unsigned() {
    let array = decode(
        "tinyint",
        vec![ColumnData::U8(Some(255)), ColumnData::U8(None)],
    );
    let values = downcast::<Int16Array>(&array);
    assert_eq!(values.value(0), 255);
    assert!(values.is_null(1));
    let array = decode(
        "int",
        vec![
            ColumnData::I32(Some(i32::MIN)),
            ColumnData::I32(Some(i32::MAX)),
            ColumnData::I16(Some(-7)),
        ],
    );
    assert_eq!(
        downcast::<Int32Array>(&array).values().to_vec(),
        [i32::MIN, i32::MAX, -7]
    );
    let array = decode(
        "bit",
        vec![ColumnData::Bit(Some(true)), ColumnData::Bit(None)],
    );
    assert!(downcast::<BooleanArray>(&array).value(0));
    let array = decode(
        "float",
        vec![ColumnData::F64(Some(-0.5)), ColumnData::F64(None)],
    );
    assert_eq!(downcast::<Float64Array>(&array).value(0), -0.5);
}

#[test]
fn decimals_keep_38_digits_and_money_its_four_places() {
    let widest = 10i128.pow(38) - 1;
    let array = decode(
        "decimal(38,4)",
        vec![
            ColumnData::Numeric(Some(Numeric::new_with_scale(widest, 4))),
            ColumnData::Numeric(Some(Numeric::new_with_scale(-widest, 4))),
            // A value sent at a smaller scale is rescaled to the column's.
            ColumnData::Numeric(Some(Numeric::new_with_scale(125, 2))),
            ColumnData::Numeric(None),
        ],
    );
    let values = downcast::<Decimal128Array>(&array);
    assert_eq!(values.value(0), widest);
    assert_eq!(values.value(1), -widest);
    assert_eq!(values.value(2), 12_500);
    assert!(values.is_null(3));
    // money is cast to decimal(19,4) in SQL, so it arrives as a numeric.
    let array = decode(
        "money",
        vec![ColumnData::Numeric(Some(Numeric::new_with_scale(
            i128::from(i64::MIN),
            4,
        )))],
    );
    assert_eq!(
        downcast::<Decimal128Array>(&array).value_as_string(0),
        "-922337203685477.5808"
    );
}

#[test]
fn a_decimal_with_more_places_than_planned_is_schema_changed_never_truncated() {
    // The column was decimal(10,2) when the read was planned; an ALTER COLUMN made it
    // decimal(12,4), and its change rows now arrive at scale 4.
    let data_type = "decimal(10,2)"
        .parse::<SqlType>()
        .expect("type")
        .arrow_type()
        .expect("mapped");
    let mut decoders = vec![ColumnBuilder::new(&data_type, 2).expect("decoder")];
    let exact = Row::builder()
        .column(
            "c",
            ColumnType::Null,
            ColumnData::Numeric(Some(Numeric::new_with_scale(12_500, 4))),
        )
        .build();
    append_row(&mut decoders, exact).expect("1.2500 holds at scale 2");
    let lossy = Row::builder()
        .column(
            "c",
            ColumnType::Null,
            ColumnData::Numeric(Some(Numeric::new_with_scale(12_345, 4))),
        )
        .build();
    let error = append_row(&mut decoders, lossy).expect_err("1.2345 does not");
    assert!(
        matches!(error, crate::error::Error::SchemaChanged(_)),
        "{error}"
    );
    assert!(
        error.to_string().contains("plan the range again"),
        "{error}"
    );
    let array = decoders[0].finish();
    assert_eq!(downcast::<Decimal128Array>(&array).value(0), 125);
}

#[test]
fn dates_cover_year_one_to_9999() {
    let array = decode(
        "date",
        vec![
            ColumnData::Date(Some(Date::new(0))),
            ColumnData::Date(Some(Date::new(LAST_DAY))),
            ColumnData::Date(Some(Date::new(719_162))),
            ColumnData::Date(None),
        ],
    );
    let values = downcast::<Date32Array>(&array);
    assert_eq!(
        values.value_as_date(0).expect("date").to_string(),
        "0001-01-01"
    );
    assert_eq!(
        values.value_as_date(1).expect("date").to_string(),
        "9999-12-31"
    );
    assert_eq!(values.value(2), 0, "1970-01-01 is day 0");
    assert!(values.is_null(3));
}

#[test]
fn datetime2_keeps_microseconds_and_drops_the_100ns_digit() {
    let array = decode(
        "datetime2(7)",
        vec![
            ColumnData::DateTime2(Some(datetime2(0, 0, 7))),
            ColumnData::DateTime2(Some(datetime2(LAST_DAY, 863_999_999_999, 7))),
            // 1970-01-01 12:00:00.1234567
            ColumnData::DateTime2(Some(datetime2(719_162, 432_001_234_567, 7))),
            // datetime2(3): increments are milliseconds.
            ColumnData::DateTime2(Some(datetime2(719_162, 1_234, 3))),
            ColumnData::DateTime2(None),
        ],
    );
    let values = downcast::<TimestampMicrosecondArray>(&array);
    let text = |row| values.value_as_datetime(row).expect("time").to_string();
    assert_eq!(text(0), "0001-01-01 00:00:00");
    assert_eq!(text(1), "9999-12-31 23:59:59.999999");
    assert_eq!(values.value(2), 43_200_123_456);
    assert_eq!(values.value(3), 1_234_000);
    assert!(values.is_null(4));
}

#[test]
fn datetimeoffset_is_the_utc_instant_whatever_the_offset() {
    // 2020-04-20T16:20:00Z written at +02:00 and at -03:00: one instant. (tiberius'
    // chrono DateTime<Utc> conversion reads the first as 14:20Z.)
    let days = 737_534; // 2020-04-20 since 0001-01-01
    let at_1620 = 16 * 3600 + 20 * 60;
    let array = decode(
        "datetimeoffset(7)",
        vec![
            ColumnData::DateTimeOffset(Some(DateTimeOffset::new(
                datetime2(days, at_1620 * 10_000_000, 7),
                120,
            ))),
            ColumnData::DateTimeOffset(Some(DateTimeOffset::new(
                datetime2(days, at_1620 * 10_000_000, 7),
                -180,
            ))),
        ],
    );
    let values = downcast::<TimestampMicrosecondArray>(&array);
    assert_eq!(
        array.data_type(),
        &DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into()))
    );
    for row in 0..2 {
        assert_eq!(
            values.value_as_datetime(row).expect("time").to_string(),
            "2020-04-20 16:20:00"
        );
    }
}

#[test]
fn datetime_and_smalldatetime_use_their_own_units() {
    let array = decode(
        "datetime",
        vec![
            // 1900-01-01 plus one 1/300 s tick: 3.333 ms.
            ColumnData::DateTime(Some(DateTime::new(0, 1))),
            // 1753-01-01, the smallest datetime.
            ColumnData::DateTime(Some(DateTime::new(-53_690, 0))),
        ],
    );
    let values = downcast::<TimestampMicrosecondArray>(&array);
    assert_eq!(
        values.value_as_datetime(0).expect("time").to_string(),
        "1900-01-01 00:00:00.003333"
    );
    assert_eq!(
        values.value_as_datetime(1).expect("time").to_string(),
        "1753-01-01 00:00:00"
    );
    let array = decode(
        "smalldatetime",
        vec![ColumnData::SmallDateTime(Some(SmallDateTime::new(1, 61)))],
    );
    assert_eq!(
        downcast::<TimestampMicrosecondArray>(&array)
            .value_as_datetime(0)
            .expect("time")
            .to_string(),
        "1900-01-02 01:01:00"
    );
}

#[test]
fn texts_guids_xml_and_times_become_strings() {
    let big = "x".repeat(1 << 20);
    let array = decode(
        "nvarchar(max)",
        vec![
            ColumnData::String(Some(Cow::Borrowed(""))),
            ColumnData::String(Some(Cow::Owned(big.clone()))),
            ColumnData::String(Some(Cow::Borrowed("Größe €"))),
            ColumnData::String(None),
        ],
    );
    let values = downcast::<StringArray>(&array);
    assert_eq!(values.value(0), "");
    assert_eq!(values.value(1).len(), 1 << 20);
    assert_eq!(values.value(2), "Größe €");
    assert!(values.is_null(3));

    let guid = uuid_from_text("6f9619ff-8b86-d011-b42d-00c04fc964ff");
    let array = decode("uniqueidentifier", vec![ColumnData::Guid(Some(guid))]);
    assert_eq!(
        downcast::<StringArray>(&array).value(0),
        "6F9619FF-8B86-D011-B42D-00C04FC964FF"
    );

    let array = decode(
        "xml",
        vec![ColumnData::Xml(Some(Cow::Owned(XmlData::new(
            "<a b=\"1\"/>",
        ))))],
    );
    assert_eq!(downcast::<StringArray>(&array).value(0), "<a b=\"1\"/>");

    let array = decode(
        "time(7)",
        vec![
            ColumnData::Time(Some(Time::new(499_011_234_567, 7))),
            ColumnData::Time(Some(Time::new(863_999_999_999, 7))),
            ColumnData::Time(Some(Time::new(45_296, 0))),
            ColumnData::Time(Some(Time::new(45_296_123, 3))),
        ],
    );
    let values = downcast::<StringArray>(&array);
    assert_eq!(values.value(0), "13:51:41.1234567");
    assert_eq!(values.value(1), "23:59:59.9999999");
    assert_eq!(values.value(2), "12:34:56");
    assert_eq!(values.value(3), "12:34:56.1230000");
}

fn uuid_from_text(text: &str) -> tiberius::Uuid {
    text.parse().expect("uuid")
}

#[test]
fn binaries_keep_their_bytes() {
    let array = decode(
        "varbinary(max)",
        vec![
            ColumnData::Binary(Some(Cow::Borrowed(&[]))),
            ColumnData::Binary(Some(Cow::Owned(vec![0, 255, 16]))),
            ColumnData::Binary(None),
        ],
    );
    let values = downcast::<BinaryArray>(&array);
    assert_eq!(values.value(0), b"");
    assert_eq!(values.value(1), [0, 255, 16]);
    assert!(values.is_null(2));
}

#[test]
fn a_value_of_another_type_is_a_schema_change_not_garbage() {
    let mut decoders = vec![ColumnBuilder::new(&DataType::Int32, 1).expect("decoder")];
    let row = Row::builder()
        .column("c", ColumnType::Int8, ColumnData::I64(Some(1)))
        .build();
    let error = append_row(&mut decoders, row).expect_err("bigint into int");
    assert!(matches!(error, Error::SchemaChanged(_)), "{error}");
    assert!(error.to_string().contains("bigint"), "{error}");
    // Any NULL is a NULL, whatever type it claims.
    let row = Row::builder()
        .column("c", ColumnType::Null, ColumnData::String(None))
        .build();
    append_row(&mut decoders, row).expect("null");
    let two = Row::builder()
        .column("a", ColumnType::Int4, ColumnData::I32(Some(1)))
        .column("b", ColumnType::Int4, ColumnData::I32(Some(2)))
        .build();
    assert!(
        append_row(&mut decoders, two).is_err(),
        "column count is checked"
    );
}

fn raw(
    data_type: &str,
    length: Option<i32>,
    precision: Option<u8>,
    scale: Option<i32>,
    fraction: Option<i16>,
) -> SqlType {
    RawColumn {
        name: "c".into(),
        column_id: 1,
        ordinal: 1,
        data_type: data_type.into(),
        character_maximum_length: length,
        numeric_precision: precision,
        numeric_scale: scale,
        datetime_precision: fraction,
    }
    .sql_type()
    .expect("type")
}

#[test]
fn catalog_rows_become_declared_types() {
    assert_eq!(
        raw("nvarchar", Some(-1), None, None, None).to_string(),
        "nvarchar(max)"
    );
    assert_eq!(
        raw("varchar", Some(20), None, None, None).to_string(),
        "varchar(20)"
    );
    assert_eq!(
        raw("decimal", None, Some(38), Some(6), None).to_string(),
        "decimal(38,6)"
    );
    assert_eq!(
        raw("numeric", None, Some(9), Some(2), None).to_string(),
        "decimal(9,2)"
    );
    assert_eq!(raw("float", None, Some(53), None, None), SqlType::Float);
    assert_eq!(raw("float", None, Some(24), None, None), SqlType::Real);
    assert_eq!(
        raw("datetime2", None, None, None, Some(3)).to_string(),
        "datetime2(3)"
    );
    assert_eq!(
        raw("datetimeoffset", None, None, None, Some(7)).to_string(),
        "datetimeoffset(7)"
    );
    assert_eq!(
        raw("timestamp", Some(8), None, None, None),
        SqlType::RowVersion
    );
    assert_eq!(raw("money", None, Some(19), Some(4), None), SqlType::Money);
    for unsupported in ["sql_variant", "geography", "geometry", "hierarchyid"] {
        let sql_type = raw(unsupported, None, None, None, None);
        assert_eq!(sql_type, SqlType::Unsupported(unsupported.into()));
        assert_eq!(
            sql_type.arrow_type(),
            None,
            "refused by the planner by name"
        );
    }
}
