//! Printer columns: what `boxery get` (and `-o wide`) prints for each kind, and the API's
//! Table output (`kubectl get`). Each kind lists its columns in its [`KindInfo`]; the front
//! ends compute the cells ([`Cell`]) and make them safe to print.
//!
//! [`KindInfo`]: crate::KindInfo

use serde_json::Value;

/// One printer column of a kind.
#[derive(Debug, Clone, Copy)]
pub struct Column {
    /// The header (`NAME`, `STATUS`).
    pub name: &'static str,
    /// How a row's cell is computed from the object (as `boxery get -o json` shows it).
    pub cell: Cell,
    /// Only with `-o wide` (the API's Table: priority 1).
    pub wide: bool,
}

impl Column {
    /// A column shown in every table.
    pub const fn new(name: &'static str, cell: Cell) -> Column {
        Column {
            name,
            cell,
            wide: false,
        }
    }

    /// A column shown with `-o wide` only.
    pub const fn wide(name: &'static str, cell: Cell) -> Column {
        Column {
            name,
            cell,
            wide: true,
        }
    }
}

/// How a cell is computed. Every form names the JSON pointers it reads ([`Cell::paths`]), so
/// that a test checks each against the kind's schema.
#[derive(Debug, Clone, Copy)]
pub enum Cell {
    /// The value at a JSON pointer (`/spec/resources/cpus`) as [`text`] shows it.
    Field(&'static str),
    /// The string at a JSON pointer, or this word when there is none (a default left unwritten).
    FieldOr(&'static str, &'static str),
    /// The age of the timestamp at a JSON pointer (`5s`, `3m`, `2h`, `4d`), as kubectl shows it.
    Age(&'static str),
    /// The `Ready` condition's status, `(stale)` when it was computed for an older generation
    /// or on an earlier boot of the host (which only the front end knows).
    Ready,
    /// Computed from the values at these JSON pointers (given in this order; `Null` when missing).
    Computed(&'static [&'static str], fn(&[&Value]) -> String),
}

/// What [`Cell::Ready`] reads.
const READY_PATHS: &[&str] = &[
    "/metadata/generation",
    "/status/conditions",
    "/status/bootId",
];

impl Cell {
    /// The JSON pointers the cell reads.
    pub fn paths(&self) -> &[&'static str] {
        match self {
            Cell::Field(p) | Cell::FieldOr(p, _) | Cell::Age(p) => std::slice::from_ref(p),
            Cell::Ready => READY_PATHS,
            Cell::Computed(paths, _) => paths,
        }
    }
}

/// The value at a JSON pointer, or `Null`.
pub fn at<'a>(o: &'a Value, pointer: &str) -> &'a Value {
    o.pointer(pointer).unwrap_or(&Value::Null)
}

/// A value as a cell shows it: `<none>` for nothing, a string as it is, anything else as JSON.
pub fn text(v: &Value) -> String {
    match v {
        Value::Null => "<none>".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `NAME`, every kind's first column (an Event's table has none).
pub const NAME: Column = Column::new("NAME", Cell::Field("/metadata/name"));

/// `AGE`, every kind's last column (an Event's table has none).
pub const AGE: Column = Column::new("AGE", Cell::Age("/metadata/creationTimestamp"));

/// The columns of a kind that names none of its own.
pub const DEFAULT: &[Column] = &[NAME, AGE];

/// `STATUS` of the kinds whose controllers write a `printableStatus` (Vm, Image): it, else
/// `Terminating` while deleting, else the phase (`Pending` before there is one).
pub const STATUS: Column = Column::new(
    "STATUS",
    Cell::Computed(
        &[
            "/status/printableStatus",
            "/metadata/deletionTimestamp",
            "/status/phase",
        ],
        |v| match (v[0], v[1], v[2]) {
            (Value::String(s), _, _) => s.clone(),
            (_, Value::Null, Value::Null) => "Pending".into(),
            (_, Value::Null, phase) => text(phase),
            _ => "Terminating".into(),
        },
    ),
);

/// `SOURCE` of a Vm or Image: its one source as `KIND:NAME` (a build as `build:BASE`).
pub const SOURCE: Column = Column::new(
    "SOURCE",
    Cell::Computed(&["/spec/source"], |v| {
        match v[0].as_object().and_then(|m| m.iter().next()) {
            Some((k, v)) if v.is_string() => format!("{k}:{}", v.as_str().unwrap_or("")),
            Some((k, v)) => format!("{k}:{}", v.get("base").map(text).unwrap_or_default()),
            None => "<none>".into(),
        }
    }),
);

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn status_is_printable_status_else_terminating_else_phase() {
        let cell = |o: Value| match STATUS.cell {
            Cell::Computed(paths, f) => f(&paths.iter().map(|p| at(&o, p)).collect::<Vec<_>>()),
            _ => unreachable!(),
        };
        assert_eq!(cell(json!({})), "Pending");
        assert_eq!(cell(json!({"status": {"phase": "Running"}})), "Running");
        assert_eq!(
            cell(json!({"metadata": {"deletionTimestamp": "t"}, "status": {"phase": "Running"}})),
            "Terminating"
        );
        assert_eq!(
            cell(
                json!({"metadata": {"deletionTimestamp": "t"}, "status": {"printableStatus": "Stopping"}})
            ),
            "Stopping"
        );
    }
}
