//! Table names of the SQL stores (the claims table, the requests table): configurable,
//! validated, never interpolated unchecked. One definition for every SQL store (`idem-sql`'s
//! engines, `idem-postgres`), so a name one accepts the others accept, and all derive the same
//! index and partition names from it.

use std::fmt;

use crate::error::{Error, ErrorKind};

/// The default table name of the claims (processed messages).
pub const DEFAULT_TABLE: &str = "idem_processed";

/// The default table name of idempotent-request records.
pub const DEFAULT_REQUESTS_TABLE: &str = "idem_requests";

/// The default table name of the transactional outbox (outgoing messages); its dead letters
/// go to `<outbox>_dead_letters`.
pub const DEFAULT_OUTBOX_TABLE: &str = "idem_outbox";

/// A validated table name, optionally schema-qualified (`billing.idem_processed`).
///
/// Table names end up inside SQL text (they cannot be bind parameters), so only plain
/// identifiers are accepted: ASCII letters, digits and `_`, not starting with a digit, at most
/// 48 bytes per part — short enough that derived index names fit every engine's limit.
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
        for part in schema.iter().chain(Some(&table)) {
            let ok = !part.is_empty()
                && part.len() <= 48
                && part.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !part.as_bytes()[0].is_ascii_digit();
            if !ok {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "invalid table name {name:?}: use letters, digits and _ (at most 48 each), \
                         optionally schema-qualified as schema.table"
                    ),
                ));
            }
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

    /// The default outbox table, [`DEFAULT_OUTBOX_TABLE`].
    pub fn default_outbox() -> Self {
        Self {
            schema: None,
            table: DEFAULT_OUTBOX_TABLE.into(),
        }
    }

    /// The name as PostgreSQL resolves it: lower case. idem writes table names unquoted, and
    /// PostgreSQL folds an unquoted identifier to lower case, so `Claims`, `claims` and
    /// `CLAIMS` are one table there — but its catalog (partition names, the schema a lock key
    /// names) compares them as spelled. The PostgreSQL stores therefore use this spelling
    /// throughout. Not applied to every engine: MySQL on Linux keeps a table name's case, so a
    /// `Claims` table there is not `claims`.
    pub fn folded(&self) -> Self {
        Self {
            schema: self
                .schema
                .as_deref()
                .map(|s| s.to_ascii_lowercase().into()),
            table: self.table.to_ascii_lowercase().into(),
        }
    }

    /// The unqualified table name, used to derive index names.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The schema, if qualified.
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// Refuses a requests table that is the claims table.
    pub fn check_distinct(claims: &TableName, requests: &TableName) -> Result<(), Error> {
        if claims == requests {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "the requests table and the claims table are both {claims}; name them apart"
                ),
            ));
        }
        Ok(())
    }
}

impl Default for TableName {
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
    }

    #[test]
    fn folds_to_the_name_postgresql_resolves() {
        let t = TableName::new("Billing.Claims").unwrap();
        assert_eq!(t.to_string(), "Billing.Claims", "kept as given");
        assert_eq!(t.folded(), TableName::new("billing.claims").unwrap());
        assert_eq!(
            TableName::new("CLAIMS").unwrap().folded().to_string(),
            "claims"
        );
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
