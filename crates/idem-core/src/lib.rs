//! The vocabulary and rules of the Idempotent Consumer pattern, with no database or network
//! dependency.
//!
//! Brokers deliver at least once. idem makes handling the same message twice have exactly the
//! effect of handling it once: the consumer records the producer-set [`MessageId`] as a claim
//! **in the same database transaction as the side effect**, under a unique constraint. A
//! redelivery finds the claim and becomes an [`Outcome::Duplicate`]; the same ID with a
//! different payload [`Fingerprint`] is an [`Outcome::Conflict`] to dead-letter.
//!
//! This crate holds the types, the store traits ([`store`]) and the [`Processor`]; stores live
//! in `idem-sql` (SQLite, PostgreSQL, MySQL/MariaDB).
//!
//! ```
//! use idem_core::{ConsumerName, DerivedKey, Fingerprint, MessageId, parse_duration, Retention};
//!
//! let id = MessageId::new("payment-42")?;
//! assert!(MessageId::new("").is_err()); // the producer must set an ID
//!
//! // Same payload, same fingerprint: a redelivery. Different payload: a producer bug.
//! assert_eq!(Fingerprint::of(b"{\"amount\":100}"), Fingerprint::of(b"{\"amount\":100}"));
//!
//! // Keys for external calls, stable across reprocessing of the same message.
//! let billing = ConsumerName::new("billing")?;
//! let key = DerivedKey::new(&billing, &id, "stripe-charge");
//! assert_eq!(key, DerivedKey::new(&billing, &id, "stripe-charge"));
//!
//! // Retention must outlast the broker's redelivery window.
//! assert!(Retention::new(parse_duration("1d")?, parse_duration("7d")?).is_err());
//! # Ok::<(), idem_core::Error>(())
//! ```

mod clock;
mod derived;
mod error;
mod fingerprint;
mod handler;
pub mod hex;
mod id;
mod message;
mod outcome;
mod processor;
mod request;
mod retention;
pub mod store;
mod table;

pub use clock::{Clock, ManualClock, Stamp, StoreClock, SystemClock, Timestamp};
pub use derived::DerivedKey;
pub use error::{BoxError, Disposition, Error, ErrorKind};
pub use fingerprint::{Fingerprint, FingerprintHasher};
pub use handler::{Handler, SetHandler};
pub use id::{ConsumerName, DEFAULT_MAX_ID_LEN, MAX_CONSUMER_NAME_LEN, MessageId};
pub use message::{Identified, Message};
pub use outcome::{Claim, Outcome};
pub use processor::{Processor, ProcessorBuilder, SetBatch};
pub use request::record as request_record;
pub use request::{
    Begin, Fence, IdempotencyKey, MAX_IDEMPOTENCY_KEY_LEN, RequestAction, RequestErrorKind,
    RequestKey, RequestScope, retry_after,
};
pub use retention::{Retention, format_duration, parse_duration};
pub use store::{
    BatchClaimStore, ClaimRequest, ClaimStore, ConsumerStats, Migrate, Prune, Savepoints, Stats,
    TransactionalStore,
};
pub use table::{DEFAULT_REQUESTS_TABLE, DEFAULT_TABLE, TableName};
