//! Which captured columns a reader asks for: all of them, a list in its order, or all but
//! some. On the wire it is [`ServeOptions`]' `columns` or `except_columns`; the server
//! resolves it against the capture instances it plans (so a column excluded never leaves
//! it), and the writer holds one per table (`columns` or `except_columns` of its CLI and
//! sidecar file).
//!
//! An excluded name is matched ignoring case, as SQL Server's default collations match
//! column names: an exclusion is a privacy decision, and `Email` must not let `email`
//! through. A name no instance captures excludes nothing, so a column that a later DDL
//! drops does not break a reader that still lists it; the writer refuses such a name when
//! it starts (a typo would otherwise serve the column it meant to hide).

use crate::error::{Error, Result};
use crate::protocol::ServeOptions;

/// The captured columns a reader asks for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ColumnSelection {
    /// Every column the table's capture instances capture.
    #[default]
    All,
    /// These, in this order (names exact, as the catalog spells them).
    Only(Vec<String>),
    /// Every captured column but these (names ignoring case).
    Except(Vec<String>),
}

impl ColumnSelection {
    /// The selection of `columns` (an include list) or `except_columns`; both is an error,
    /// as is an empty include list (a read of no captured column is not a table's copy).
    pub fn new(columns: Option<Vec<String>>, except: Option<Vec<String>>) -> Result<Self> {
        match (columns, except) {
            (Some(_), Some(_)) => Err(Error::invalid(
                "give columns (the ones to serve) or except_columns (the ones not to), not both",
            )),
            (Some(columns), None) if columns.is_empty() => Err(Error::invalid(
                "columns lists no column; leave it out to serve every captured column",
            )),
            (Some(columns), None) => Ok(ColumnSelection::Only(columns)),
            (None, Some(except)) if !except.is_empty() => Ok(ColumnSelection::Except(except)),
            (None, _) => Ok(ColumnSelection::All),
        }
    }

    /// The selection a configuration gives, `None` when it names neither list (its reader
    /// then follows the one recorded elsewhere); an empty `except_columns` says every
    /// column.
    pub fn given(
        columns: Option<Vec<String>>,
        except: Option<Vec<String>>,
    ) -> Result<Option<Self>> {
        match (&columns, &except) {
            (None, None) => Ok(None),
            _ => ColumnSelection::new(columns, except).map(Some),
        }
    }

    /// The selection a command's serve options ask for.
    pub fn of(serve: &ServeOptions) -> Result<Self> {
        ColumnSelection::new(serve.columns.clone(), serve.except_columns.clone())
    }

    /// Serve options asking for this selection, every other option at its default.
    pub fn serve(&self) -> ServeOptions {
        let mut serve = ServeOptions::default();
        self.apply(&mut serve);
        serve
    }

    /// Makes `serve` ask for this selection (whatever columns it asked for before).
    pub fn apply(&self, serve: &mut ServeOptions) {
        (serve.columns, serve.except_columns) = match self {
            ColumnSelection::All => (None, None),
            ColumnSelection::Only(columns) => (Some(columns.clone()), None),
            ColumnSelection::Except(except) => (None, Some(except.clone())),
        };
    }

    /// Whether a captured column named `name` is left out.
    pub fn excludes(&self, name: &str) -> bool {
        match self {
            ColumnSelection::All => false,
            ColumnSelection::Only(columns) => !columns.iter().any(|column| column == name),
            ColumnSelection::Except(except) => except.iter().any(|column| same_name(column, name)),
        }
    }

    /// Whether `other` selects the same columns: the same names (an include list's in any
    /// order, an exclusion's ignoring case), so a restatement is not a change.
    pub fn same_as(&self, other: &ColumnSelection) -> bool {
        let folded = |names: &[String]| -> std::collections::BTreeSet<String> {
            names.iter().map(|name| name.to_lowercase()).collect()
        };
        match (self, other) {
            (ColumnSelection::All, ColumnSelection::All) => true,
            (ColumnSelection::Only(mine), ColumnSelection::Only(theirs)) => {
                let sorted = |names: &[String]| {
                    let mut names = names.to_vec();
                    names.sort();
                    names
                };
                sorted(mine) == sorted(theirs)
            }
            (ColumnSelection::Except(mine), ColumnSelection::Except(theirs)) => {
                folded(mine) == folded(theirs)
            }
            _ => false,
        }
    }

    /// The selection as JSON (`{"columns": [...]}` or `{"except_columns": [...]}`), `None`
    /// for every column: how the lake records it.
    pub fn to_json(&self) -> Option<String> {
        let serve = self.serve();
        let (field, names) = match (serve.columns, serve.except_columns) {
            (Some(names), _) => ("columns", names),
            (_, Some(names)) => ("except_columns", names),
            (None, None) => return None,
        };
        Some(serde_json::json!({ field: names }).to_string())
    }

    /// The selection [`ColumnSelection::to_json`] wrote.
    pub fn from_json(text: &str) -> Result<Self> {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Lists {
            columns: Option<Vec<String>>,
            except_columns: Option<Vec<String>>,
        }
        let lists: Lists = serde_json::from_str(text)
            .map_err(|error| Error::invalid(format!("a column selection: {error}: {text}")))?;
        ColumnSelection::new(lists.columns, lists.except_columns)
    }

    /// The names this selection lists (none for [`ColumnSelection::All`]).
    pub fn names(&self) -> &[String] {
        match self {
            ColumnSelection::All => &[],
            ColumnSelection::Only(names) | ColumnSelection::Except(names) => names,
        }
    }

    /// The selected of `captured` (each item named by `name`), in the order the selection
    /// asks for: an include list's order, else the captured order. A listed column no
    /// instance captures, or one listed twice, is an error of an include list only.
    pub fn select<'a, T>(
        &self,
        captured: &'a [T],
        name: impl Fn(&T) -> &str,
    ) -> std::result::Result<Vec<&'a T>, SelectionError> {
        let ColumnSelection::Only(columns) = self else {
            return Ok(captured
                .iter()
                .filter(|item| !self.excludes(name(item)))
                .collect());
        };
        let mut selected: Vec<&T> = Vec::with_capacity(columns.len());
        for wanted in columns {
            if selected.iter().any(|item| name(item) == wanted) {
                return Err(SelectionError::Twice(wanted.clone()));
            }
            let item = captured
                .iter()
                .find(|item| name(item) == wanted)
                .ok_or_else(|| SelectionError::NotCaptured(wanted.clone()))?;
            selected.push(item);
        }
        Ok(selected)
    }
}

impl std::fmt::Display for ColumnSelection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ColumnSelection::All => write!(f, "every captured column"),
            ColumnSelection::Only(names) => write!(f, "columns {names:?}"),
            ColumnSelection::Except(names) => write!(f, "except_columns {names:?}"),
        }
    }
}

/// Why an include list cannot be served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SelectionError {
    /// The column is listed twice.
    Twice(String),
    /// No capture instance of the table captures the column.
    NotCaptured(String),
}

/// Whether two column names are one under a case-insensitive collation.
pub fn same_name(left: &str, right: &str) -> bool {
    left == right || left.to_lowercase() == right.to_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(selection: &ColumnSelection, captured: &[&str]) -> Vec<String> {
        selection
            .select(captured, |name| name)
            .expect("selects")
            .into_iter()
            .map(|name| name.to_string())
            .collect()
    }

    #[test]
    fn an_exclusion_ignores_case_and_names_no_instance_captures() {
        let captured = ["id", "Email", "name"];
        let except = ColumnSelection::new(None, Some(vec!["EMAIL".into(), "gone".into()]));
        assert_eq!(names(&except.expect("valid"), &captured), ["id", "name"]);
    }

    #[test]
    fn an_include_list_keeps_its_order_and_refuses_what_it_cannot_serve() {
        let captured = ["id", "email", "name"];
        let only = ColumnSelection::new(Some(vec!["name".into(), "id".into()]), None);
        let only = only.expect("valid");
        assert_eq!(names(&only, &captured), ["name", "id"]);
        assert!(only.excludes("email") && !only.excludes("id"));
        let twice = ColumnSelection::Only(vec!["id".into(), "id".into()]);
        assert_eq!(
            twice.select(&captured, |name| name),
            Err(SelectionError::Twice("id".into()))
        );
        let missing = ColumnSelection::Only(vec!["Name".into()]);
        assert_eq!(
            missing.select(&captured, |name| name),
            Err(SelectionError::NotCaptured("Name".into()))
        );
    }

    #[test]
    fn both_lists_or_an_empty_include_list_are_refused() {
        let both = ColumnSelection::new(Some(vec!["a".into()]), Some(vec!["b".into()]));
        assert!(both.is_err());
        assert!(ColumnSelection::new(Some(Vec::new()), None).is_err());
        assert_eq!(
            ColumnSelection::new(None, Some(Vec::new())).expect("valid"),
            ColumnSelection::All
        );
        let except = ColumnSelection::Except(vec!["email".into()]);
        let serve = except.serve();
        assert_eq!(ColumnSelection::of(&serve).expect("valid"), except);
    }

    #[test]
    fn a_restated_selection_is_the_same_and_its_json_reads_back() {
        let except = ColumnSelection::Except(vec!["Email".into(), "phone".into()]);
        let restated = ColumnSelection::Except(vec!["PHONE".into(), "email".into()]);
        assert!(except.same_as(&restated));
        assert!(!except.same_as(&ColumnSelection::Except(vec!["email".into()])));
        let only = ColumnSelection::Only(vec!["b".into(), "a".into()]);
        assert!(only.same_as(&ColumnSelection::Only(vec!["a".into(), "b".into()])));
        assert!(!only.same_as(&ColumnSelection::Only(vec!["A".into(), "b".into()])));
        assert!(
            !only.same_as(&ColumnSelection::All)
                && ColumnSelection::All.same_as(&ColumnSelection::All)
        );
        for selection in [except, only] {
            let json = selection.to_json().expect("a list");
            assert_eq!(ColumnSelection::from_json(&json).expect("reads"), selection);
        }
        assert_eq!(ColumnSelection::All.to_json(), None);
        assert!(
            ColumnSelection::from_json(r#"{"columns": ["a"], "except_columns": ["b"]}"#).is_err()
        );
    }
}
