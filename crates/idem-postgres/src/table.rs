//! Table names (the claims table, the requests table): configurable, validated, never
//! interpolated unchecked. The rules are `idem-sql`'s, so a name one store accepts the other
//! accepts too, and both derive the same index names from it.

use std::fmt;

use idem_core::{Error, ErrorKind};

/// The default table of claims (processed messages), as in `idem-sql`.
pub const DEFAULT_TABLE: &str = "idem_processed";

/// The default table of idempotent-request records, as in `idem-sql`.
pub const DEFAULT_REQUESTS_TABLE: &str = "idem_requests";

/// A validated table name, optionally schema-qualified (`billing.idem_processed`).
///
/// Table names end up inside SQL text (they cannot be bind parameters), so only plain
/// identifiers are accepted: ASCII letters, digits and `_`, not starting with a digit, at most
/// 48 bytes per part — short enough that derived index names stay inside PostgreSQL's 63.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    schema: Option<Box<str>>,
    table: Box<str>,
}

impl TableName {
    /// Validates a table name.
    pub fn new(name: &str) -> Result<Self, Error> {
        let (schema, table) = match name.split_once('.') {
            Some((s, t)) => (Some(s), t),
            None => (None, name),
        };
        let plain = |part: &str| {
            !part.is_empty()
                && part.len() <= 48
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !part.as_bytes()[0].is_ascii_digit()
        };
        if !schema.into_iter().chain(Some(table)).all(plain) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "invalid table name {name:?}: use letters, digits and _ (at most 48 each), \
                     optionally schema-qualified as schema.table"
                ),
            ));
        }
        Ok(Self {
            schema: schema.map(Into::into),
            table: table.into(),
        })
    }

    /// The default requests table, [`DEFAULT_REQUESTS_TABLE`].
    pub fn default_requests() -> Self {
        Self {
            schema: None,
            table: DEFAULT_REQUESTS_TABLE.into(),
        }
    }

    /// The unqualified table name, which index names are derived from.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The schema, if qualified.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }
}

impl Default for TableName {
    /// [`DEFAULT_TABLE`].
    fn default() -> Self {
        Self {
            schema: None,
            table: DEFAULT_TABLE.into(),
        }
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.schema {
            Some(s) => write!(f, "{s}.{}", self.table),
            None => f.write_str(&self.table),
        }
    }
}

impl fmt::Debug for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TableName({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_qualified_names() {
        assert_eq!(
            TableName::new("idem_processed").unwrap().to_string(),
            "idem_processed"
        );
        let t = TableName::new("billing.claims").unwrap();
        assert_eq!((t.schema(), t.table()), (Some("billing"), "claims"));
        assert_eq!(TableName::default().to_string(), DEFAULT_TABLE);
    }

    #[test]
    fn rejects_anything_that_could_escape_an_identifier() {
        for bad in [
            "",
            "a b",
            "t;drop table x",
            "1abc",
            "a.b.c",
            "\"t\"",
            "a-b",
            &"x".repeat(49),
        ] {
            let err = TableName::new(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidConfig, "{bad:?}");
        }
    }
}
