//! The SQL a Flight SQL client may send (docs/sql.md), parsed with sqlparser and mapped onto
//! the server's own plans: never evaluated, so a query costs what its plan costs and nothing
//! beyond the documented forms is accepted.
//!
//! - `SELECT <columns> FROM schema.table [WHERE <key> BETWEEN a AND b]`: a snapshot read;
//! - `SELECT <columns> FROM cdc.changes('schema.table', from, to [, max_commits])`: a change
//!   range (`from` exclusive; `earliest`, `latest`, an LSN or an offset's JSON);
//! - `SELECT * FROM cdc.max_lsn()`, `cdc.lsn_to_time(lsn)`, `cdc.time_to_lsn(time)`,
//!   `cdc.initial_offset('schema.table', starting)`, `cdc.latest_offset(start, max_commits)`:
//!   the planning calls, one row each.

use std::sync::LazyLock;

use sqlparser::ast::{
    self, BinaryOperator, Expr, FunctionArg, FunctionArgExpr, SelectItem, SetExpr, TableFactor,
    Value,
};
use sqlparser::dialect::MsSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::{Token, Tokenizer};

use crate::Lsn;
use crate::error::{Error, Result};
use crate::keys::Bound;
use crate::offset::{CommitTime, Offset};
use crate::protocol::{ChangesCommand, ChunkSpec, ServeOptions, SnapshotCommand};
use crate::types::RESERVED_COLUMN_NAMES;

/// The longest statement taken, in bytes: the grammar needs a few hundred, a wide table's
/// column list a few thousand.
pub const MAX_SQL_BYTES: usize = 64 << 10;
/// Operators (`AND`, `-`, `>=`, `*`, ...) a statement may hold: a key range with negative
/// bounds needs five. sqlparser bounds nesting, not chains: `1+1+...` or a long `UNION`
/// parses into a tree as deep as it is long, which its clone and drop recurse through, so a
/// chain is refused on the flat tokens before any tree is built.
const MAX_OPERATORS: usize = 8;
/// Parentheses deep: a function's argument list needs one.
const MAX_NESTING: usize = 4;
/// Characters of a client's text a refusal repeats.
const ECHOED_CHARS: usize = 200;

/// What a statement names the forms the server takes, for every refusal.
const SUPPORTED: &str = "supported: SELECT <columns> FROM <schema.table> [WHERE <key> BETWEEN \
                         a AND b], SELECT <columns> FROM cdc.changes('<schema.table>', <from>, \
                         <to> [, <max_commits>]), and SELECT * FROM cdc.max_lsn(), \
                         cdc.lsn_to_time(<lsn>), cdc.time_to_lsn(<time>), \
                         cdc.initial_offset('<schema.table>', <starting>), \
                         cdc.latest_offset(<start>, <max_commits>) (docs/sql.md)";

/// A statement the server serves.
#[derive(Clone, Debug, PartialEq)]
pub enum Statement {
    /// A read of a table's current rows; `range` bounds its key.
    Snapshot {
        /// The command, its columns set.
        command: SnapshotCommand,
        /// `WHERE <key> BETWEEN lo AND hi`.
        range: Option<KeyRange>,
    },
    /// A change range.
    Changes(ChangesQuery),
    /// A planning call.
    Function(Function),
}

/// `WHERE <column> BETWEEN lo AND hi` on a snapshot: the planner checks the column is the
/// table's integer key.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyRange {
    /// The column named.
    pub column: String,
    /// First key (inclusive).
    pub lo: i64,
    /// Last key (inclusive).
    pub hi: i64,
}

impl KeyRange {
    /// The range as the one chunk of a snapshot command, `[lo, hi + 1)`.
    pub fn chunk(&self) -> ChunkSpec {
        ChunkSpec {
            chunk: 0,
            lo: Some(Bound::Int(self.lo)),
            hi: self.hi.checked_add(1).map(Bound::Int),
        }
    }
}

/// `cdc.changes(table, from, to, max_commits)`.
#[derive(Clone, Debug, PartialEq)]
pub struct ChangesQuery {
    /// `schema.table`.
    pub table: String,
    /// Where the range starts (exclusive).
    pub from: Point,
    /// Where it ends (inclusive).
    pub to: Point,
    /// At most this many commits after `from`.
    pub max_commits: Option<u64>,
    /// The captured columns selected; `None` for `*`.
    pub columns: Option<Vec<String>>,
}

impl ChangesQuery {
    /// The changes command of the range `(from, to]` once both ends are LSNs.
    pub fn command(&self, from: Lsn, to: Option<Lsn>, partitions: u32) -> ChangesCommand {
        ChangesCommand {
            table: self.table.clone(),
            from,
            to,
            capture_instance: None,
            partitions: Some(partitions),
            min_partition_rows: None,
            serve: serve(self.columns.clone()),
        }
    }
}

/// An end of a change range.
#[derive(Clone, Debug, PartialEq)]
pub enum Point {
    /// Before the table's first change still held.
    Earliest,
    /// `max_lsn`.
    Latest,
    /// An LSN, or an offset's.
    Lsn(Lsn),
}

/// A planning call, served as one row.
#[derive(Clone, Debug, PartialEq)]
pub enum Function {
    /// `cdc.max_lsn()`.
    MaxLsn,
    /// `cdc.lsn_to_time(lsn)`.
    LsnToTime(Lsn),
    /// `cdc.time_to_lsn(time)`.
    TimeToLsn(CommitTime),
    /// `cdc.initial_offset(table, starting)`.
    InitialOffset {
        /// `schema.table`.
        table: String,
        /// `earliest`, `latest` or an LSN.
        starting: String,
    },
    /// `cdc.latest_offset(start, max_commits)`.
    LatestOffset {
        /// The current offset, its time too when given as JSON.
        start: Offset,
        /// At most this many commits after it.
        max_commits: Option<u64>,
    },
}

/// The `cdc` functions, each with the columns of its rows: for a planning call, its
/// action's answer fields, as text; none known for `changes`, whose columns are its table's.
pub const FUNCTIONS: [(&str, &[&str]); 6] = [
    ("changes", &[]),
    ("max_lsn", &["lsn"]),
    ("lsn_to_time", &["commit_ts"]),
    ("time_to_lsn", &["lsn"]),
    ("initial_offset", &["lsn", "commit_ts"]),
    ("latest_offset", &["lsn", "commit_ts"]),
];

impl Function {
    /// Its name in SQL, which is the name of the action that answers it.
    pub fn name(&self) -> &'static str {
        match self {
            Function::MaxLsn => "max_lsn",
            Function::LsnToTime(_) => "lsn_to_time",
            Function::TimeToLsn(_) => "time_to_lsn",
            Function::InitialOffset { .. } => "initial_offset",
            Function::LatestOffset { .. } => "latest_offset",
        }
    }

    /// The action that answers it and its body.
    pub fn action(&self) -> (&'static str, serde_json::Value) {
        use serde_json::json;
        let body = match self {
            Function::MaxLsn => json!({}),
            Function::LsnToTime(lsn) => json!({ "lsn": lsn }),
            Function::TimeToLsn(time) => json!({ "time": time }),
            Function::InitialOffset { table, starting } => {
                json!({ "table": table, "starting": starting })
            }
            Function::LatestOffset { start, max_commits } => {
                json!({ "start": start, "max_commits": max_commits })
            }
        };
        (self.name(), body)
    }

    /// The columns of its row ([`FUNCTIONS`]).
    pub fn columns(&self) -> &'static [&'static str] {
        FUNCTIONS
            .iter()
            .find(|(name, _)| *name == self.name())
            .map_or(&[], |(_, columns)| columns)
    }

    /// The table it reads, when it reads one.
    pub fn table(&self) -> Option<&str> {
        match self {
            Function::InitialOffset { table, .. } => Some(table),
            _ => None,
        }
    }
}

/// The serve options of a statement's column list.
fn serve(columns: Option<Vec<String>>) -> ServeOptions {
    ServeOptions {
        columns,
        ..ServeOptions::default()
    }
}

/// The parts of a statement beyond `SELECT <projection> FROM <one relation> [WHERE ...]`,
/// blanked: a query equal to it after the same blanking has no other clause.
static BARE_QUERY: LazyLock<ast::Query> = LazyLock::new(|| {
    let parsed =
        Parser::parse_sql(&MsSqlDialect {}, "SELECT a FROM t").map(
            |mut statements| match statements.pop() {
                Some(ast::Statement::Query(query)) => Some(*query),
                _ => None,
            },
        );
    let Ok(Some(mut query)) = parsed else {
        unreachable!("the template query parses")
    };
    blank(&mut query);
    query
});

/// Clears the clauses a supported statement may hold.
fn blank(query: &mut ast::Query) {
    if let SetExpr::Select(select) = query.body.as_mut() {
        select.projection.clear();
        select.from.clear();
        select.selection = None;
    }
}

/// At most [`ECHOED_CHARS`] of a client's text, for a refusal to repeat.
fn echo(text: &str) -> String {
    match text.char_indices().nth(ECHOED_CHARS) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

/// Refuses, on its flat tokens, a statement too long, too deeply parenthesized, with a set
/// operation or with more operators than the grammar uses: no tree is built for those.
fn guard(sql: &str, refuse: impl Fn(&str) -> Error) -> Result<()> {
    if sql.len() > MAX_SQL_BYTES {
        return Err(refuse(&format!(
            "the statement is {} bytes, more than the {MAX_SQL_BYTES} taken",
            sql.len()
        )));
    }
    let tokens = Tokenizer::new(&MsSqlDialect {}, sql)
        .tokenize()
        .map_err(|error| {
            refuse(&format!(
                "the statement does not parse ({})",
                echo(&error.to_string())
            ))
        })?;
    let (mut operators, mut depth) = (0usize, 0usize);
    for token in &tokens {
        match token {
            Token::LParen => {
                depth += 1;
                if depth > MAX_NESTING {
                    return Err(refuse(&format!(
                        "parentheses nest deeper than {MAX_NESTING}"
                    )));
                }
            }
            Token::RParen => depth = depth.saturating_sub(1),
            Token::Word(word) => match word.keyword {
                Keyword::UNION | Keyword::EXCEPT | Keyword::INTERSECT | Keyword::MINUS => {
                    return Err(refuse(
                        "UNION, VALUES and other set operations are not supported",
                    ));
                }
                Keyword::AND | Keyword::OR | Keyword::NOT | Keyword::XOR => operators += 1,
                _ => {}
            },
            Token::Number(..)
            | Token::SingleQuotedString(_)
            | Token::NationalStringLiteral(_)
            | Token::Comma
            | Token::Period
            | Token::Whitespace(_)
            | Token::SemiColon
            | Token::EOF => {}
            _ => operators += 1,
        }
        if operators > MAX_OPERATORS {
            return Err(refuse(&format!(
                "the statement holds more than {MAX_OPERATORS} operators: expressions are not \
                 supported"
            )));
        }
    }
    Ok(())
}

/// Parses `sql` into a [`Statement`]; anything else is `INVALID_ARGUMENT` naming the forms
/// the server takes.
pub fn parse(sql: &str) -> Result<Statement> {
    let refuse = |what: &str| Error::invalid(format!("{what}; {SUPPORTED}"));
    guard(sql, refuse)?;
    let mut statements = Parser::parse_sql(&MsSqlDialect {}, sql).map_err(|error| {
        refuse(&format!(
            "the statement does not parse ({})",
            echo(&error.to_string())
        ))
    })?;
    let query = match (statements.pop(), statements.is_empty()) {
        (Some(ast::Statement::Query(query)), true) => *query,
        (Some(ast::Statement::Query(_)), false) => return Err(refuse("one statement at a time")),
        (Some(_), _) => {
            return Err(refuse(
                "the server is read-only and answers queries only (no writes, DDL or \
                 session statements)",
            ));
        }
        (None, _) => return Err(refuse("the statement is empty")),
    };
    let mut rest = query.clone();
    blank(&mut rest);
    let SetExpr::Select(select) = *query.body else {
        return Err(refuse(
            "UNION, VALUES and other set operations are not supported",
        ));
    };
    if rest != *BARE_QUERY {
        return Err(refuse(
            "only the projection, one FROM relation and a key range are supported (no \
             joins, aggregates, GROUP BY, ORDER BY, TOP, LIMIT, DISTINCT or WITH)",
        ));
    }
    let [from] = select.from.as_slice() else {
        return Err(refuse("a statement reads exactly one relation"));
    };
    if !from.joins.is_empty() {
        return Err(refuse("joins are not supported"));
    }
    let TableFactor::Table {
        name,
        alias,
        args,
        with_hints,
        version,
        with_ordinality,
        partitions,
        json_path,
        sample,
        index_directives,
        inheritance,
    } = &from.relation
    else {
        return Err(refuse("subqueries and derived tables are not supported"));
    };
    // Every clause on the relation changes what it reads (a time travel, a sample, renamed
    // columns) or how (hints: the server reads under the source's own isolation), so none
    // is passed over.
    if version.is_some()
        || sample.is_some()
        || json_path.is_some()
        || inheritance.is_some()
        || *with_ordinality
        || !partitions.is_empty()
        || !index_directives.is_empty()
        || alias
            .as_ref()
            .is_some_and(|alias| !alias.columns.is_empty())
    {
        return Err(refuse(&format!(
            "'{}' is not supported: a relation takes no FOR SYSTEM_TIME, TABLESAMPLE, \
             partitions, index hints or column aliases",
            echo(&from.relation.to_string())
        )));
    }
    if !with_hints.is_empty() {
        return Err(refuse(
            "table hints are not supported: the server reads under the source's own isolation",
        ));
    }
    let name = object_name(name)?;
    let columns = projection(&select.projection).map_err(|what| refuse(&what))?;
    let Some(args) = args else {
        // A table: a snapshot read.
        let range = select
            .selection
            .as_ref()
            .map(key_range)
            .transpose()
            .map_err(|what| refuse(&what))?;
        return Ok(Statement::Snapshot {
            command: SnapshotCommand {
                serve: serve(columns),
                ..SnapshotCommand::new(name)
            },
            range,
        });
    };
    if select.selection.is_some() {
        return Err(refuse("a function's rows take no WHERE"));
    }
    let lowered = name.to_ascii_lowercase();
    let function = lowered.strip_prefix("cdc.").ok_or_else(|| {
        refuse(&format!(
            "'{}(...)' is not a cdc function (a table takes no arguments or hints)",
            echo(&name)
        ))
    })?;
    let args = arguments(&args.args).map_err(|what| refuse(&what))?;
    if function != "changes" && columns.is_some() {
        return Err(refuse(&format!("select * from cdc.{function}(...)")));
    }
    let arity = |low: usize, high: usize| match (low..=high).contains(&args.len()) {
        true => Ok(()),
        false => Err(refuse(&format!(
            "cdc.{function} takes {low} to {high} arguments, not {}",
            args.len()
        ))),
    };
    Ok(match function {
        "changes" => {
            arity(2, 4)?;
            Statement::Changes(ChangesQuery {
                table: args[0].text("the table")?,
                from: args[1].point()?,
                to: args
                    .get(2)
                    .map(Argument::point)
                    .transpose()?
                    .unwrap_or(Point::Latest),
                max_commits: args.get(3).map(Argument::count).transpose()?,
                columns,
            })
        }
        "max_lsn" => {
            arity(0, 0)?;
            Statement::Function(Function::MaxLsn)
        }
        "lsn_to_time" => {
            arity(1, 1)?;
            Statement::Function(Function::LsnToTime(args[0].lsn()?))
        }
        "time_to_lsn" => {
            arity(1, 1)?;
            let text = args[0].text("the time")?;
            let time = CommitTime::parse_iso(&text)
                .map_err(|error| Error::invalid(format!("the time '{text}': {}", error.0)))?;
            Statement::Function(Function::TimeToLsn(time))
        }
        "initial_offset" => {
            arity(1, 2)?;
            Statement::Function(Function::InitialOffset {
                table: args[0].text("the table")?,
                starting: match args.get(1) {
                    Some(argument) => argument.text("starting")?,
                    None => "earliest".into(),
                },
            })
        }
        "latest_offset" => {
            arity(1, 2)?;
            Statement::Function(Function::LatestOffset {
                start: offset(&args[0].text("the start")?)?,
                max_commits: args.get(1).map(Argument::count).transpose()?,
            })
        }
        other => return Err(refuse(&format!("unknown function 'cdc.{}'", echo(other)))),
    })
}

/// A name as the protocol writes a table (`schema.table`, docs/protocol.md): each part as
/// parsed, bracketed again when it holds what a bare part may not.
fn object_name(name: &ast::ObjectName) -> Result<String> {
    let parts: Vec<String> = name
        .0
        .iter()
        .map(|part| match part.as_ident() {
            Some(ident)
                if ident.value.contains(['.', '[', ']']) || ident.value.trim() != ident.value =>
            {
                Ok(format!("[{}]", ident.value.replace(']', "]]")))
            }
            Some(ident) => Ok(ident.value.clone()),
            None => Err(Error::invalid(format!(
                "'{}' is not a plain name",
                echo(&name.to_string())
            ))),
        })
        .collect::<Result<_>>()?;
    Ok(parts.join("."))
}

/// The captured columns a projection names; `None` for `*`. Metadata columns are served
/// with every row anyway, so naming them selects nothing more.
fn projection(items: &[SelectItem]) -> std::result::Result<Option<Vec<String>>, String> {
    if let [SelectItem::Wildcard(options)] = items {
        if options.opt_exclude.is_some()
            || options.opt_except.is_some()
            || options.opt_replace.is_some()
            || options.opt_rename.is_some()
        {
            return Err("* takes no EXCLUDE, EXCEPT, REPLACE or RENAME".into());
        }
        return Ok(None);
    }
    let mut columns = Vec::new();
    for item in items {
        match item {
            SelectItem::UnnamedExpr(Expr::Identifier(ident)) => {
                let reserved = RESERVED_COLUMN_NAMES
                    .iter()
                    .any(|name| name.eq_ignore_ascii_case(&ident.value));
                if !reserved {
                    columns.push(ident.value.clone());
                }
            }
            SelectItem::Wildcard(_) => return Err("* stands alone in a projection".into()),
            SelectItem::ExprWithAlias { .. } => {
                return Err("column aliases are not supported".into());
            }
            other => {
                return Err(format!(
                    "'{}' is not a column: expressions and aggregates are not supported",
                    echo(&other.to_string())
                ));
            }
        }
    }
    if columns.is_empty() {
        return Err("name at least one captured column, or *".into());
    }
    Ok(Some(columns))
}

/// `<key> BETWEEN lo AND hi`, or `<key> >= lo AND <key> <= hi`.
fn key_range(condition: &Expr) -> std::result::Result<KeyRange, String> {
    let unsupported = || {
        format!(
            "WHERE '{}' is not supported: a snapshot takes only <key> BETWEEN a AND b on its \
             integer key",
            echo(&condition.to_string())
        )
    };
    let column = |expr: &Expr| match expr {
        Expr::Identifier(ident) => Some(ident.value.clone()),
        Expr::Nested(inner) => match inner.as_ref() {
            Expr::Identifier(ident) => Some(ident.value.clone()),
            _ => None,
        },
        _ => None,
    };
    let range = match condition {
        Expr::Between {
            expr,
            negated: false,
            low,
            high,
        } => column(expr).zip(integer(low).zip(integer(high))),
        Expr::BinaryOp {
            left,
            op: BinaryOperator::And,
            right,
        } => match (left.as_ref(), right.as_ref()) {
            (
                Expr::BinaryOp {
                    left: a,
                    op: BinaryOperator::GtEq,
                    right: lo,
                },
                Expr::BinaryOp {
                    left: b,
                    op: BinaryOperator::LtEq,
                    right: hi,
                },
            ) => column(a)
                .filter(|name| column(b).as_ref() == Some(name))
                .zip(integer(lo).zip(integer(hi))),
            _ => None,
        },
        _ => None,
    };
    let (column, (lo, hi)) = range.ok_or_else(unsupported)?;
    if lo > hi {
        return Err(format!("the key range {lo} to {hi} is empty"));
    }
    Ok(KeyRange { column, lo, hi })
}

/// An integer literal, negative ones too (`i64::MIN` included: its digits alone overflow).
fn integer(expr: &Expr) -> Option<i64> {
    fn wide(expr: &Expr) -> Option<i128> {
        match expr {
            Expr::Value(value) => match &value.value {
                Value::Number(text, _) => text.parse().ok(),
                _ => None,
            },
            Expr::UnaryOp {
                op: ast::UnaryOperator::Minus,
                expr,
            } => wide(expr)?.checked_neg(),
            _ => None,
        }
    }
    wide(expr)?.try_into().ok()
}

/// A function's argument: a string or a number literal, or NULL.
#[derive(Debug)]
enum Argument {
    Text(String),
    Number(String),
    Null,
}

fn arguments(args: &[FunctionArg]) -> std::result::Result<Vec<Argument>, String> {
    args.iter()
        .map(|arg| match arg {
            FunctionArg::Unnamed(FunctionArgExpr::Expr(expr)) => literal(expr).ok_or_else(|| {
                format!(
                    "the argument '{}' is not a literal: arguments are strings or numbers",
                    echo(&expr.to_string())
                )
            }),
            other => Err(format!(
                "the argument '{}' is not supported: arguments are positional literals",
                echo(&other.to_string())
            )),
        })
        .collect()
}

fn literal(expr: &Expr) -> Option<Argument> {
    match expr {
        Expr::Value(value) => match &value.value {
            Value::SingleQuotedString(text) | Value::NationalStringLiteral(text) => {
                Some(Argument::Text(text.clone()))
            }
            Value::Number(text, _) => Some(Argument::Number(text.clone())),
            Value::Null => Some(Argument::Null),
            _ => None,
        },
        _ => None,
    }
}

impl Argument {
    fn text(&self, what: &str) -> Result<String> {
        match self {
            Argument::Text(text) => Ok(text.clone()),
            other => Err(Error::invalid(format!(
                "{what} is a string literal, not {}",
                echo(&format!("{other:?}"))
            ))),
        }
    }

    /// `'earliest'`, `'latest'`, an LSN (`'0x...'`) or an offset's JSON.
    fn point(&self) -> Result<Point> {
        let text = self.text("a range end")?;
        let trimmed = text.trim();
        Ok(if trimmed.eq_ignore_ascii_case("earliest") {
            Point::Earliest
        } else if trimmed.eq_ignore_ascii_case("latest") {
            Point::Latest
        } else {
            Point::Lsn(offset(&text)?.lsn)
        })
    }

    fn lsn(&self) -> Result<Lsn> {
        Ok(offset(&self.text("an LSN")?)?.lsn)
    }

    /// A count of commits: a positive integer.
    fn count(&self) -> Result<u64> {
        match self {
            Argument::Number(text) => text
                .parse::<u64>()
                .ok()
                .filter(|count| *count > 0)
                .ok_or_else(|| {
                    Error::invalid(format!(
                        "max_commits is a positive integer, not {}",
                        echo(text)
                    ))
                }),
            other => Err(Error::invalid(format!(
                "max_commits is a positive integer, not {}",
                echo(&format!("{other:?}"))
            ))),
        }
    }
}

/// An offset's JSON (`{"lsn": ..., "commit_ts": ...}`), or an LSN in hex (`0x...`) as an
/// offset of no known time.
fn offset(text: &str) -> Result<Offset> {
    let trimmed = text.trim();
    if trimmed.starts_with('{') {
        return serde_json::from_str(trimmed)
            .map_err(|error| Error::invalid(format!("the offset {}: {error}", echo(trimmed))));
    }
    let lsn = trimmed.parse::<Lsn>().map_err(|error| {
        Error::invalid(format!(
            "the LSN '{}': {}",
            echo(trimmed),
            echo(&error.to_string())
        ))
    })?;
    Ok(Offset::new(lsn, None))
}

#[cfg(test)]
#[path = "statement_tests.rs"]
mod tests;
