//! `parse_duration` (CLI flags, config) and `format_duration` (error messages, `idem prune`).
//!
//! - Arbitrary text: no panic; an accepted duration is a whole number of milliseconds and
//!   `format_duration` of it parses back to the same duration.
//! - Arbitrary durations at millisecond precision (what the parser can express): formatting
//!   then parsing is the identity.
#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use idem_core::{ErrorKind, format_duration, parse_duration};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    text: &'a str,
    secs: u64,
    millis: u16,
}

fuzz_target!(|input: Input<'_>| {
    match parse_duration(input.text) {
        Ok(d) => {
            assert_eq!(d.subsec_nanos() % 1_000_000, 0, "{:?} -> {d:?}", input.text);
            round_trips(d);
        }
        Err(e) => assert_eq!(e.kind(), ErrorKind::InvalidConfig),
    }
    round_trips(Duration::new(
        input.secs,
        u32::from(input.millis % 1000) * 1_000_000,
    ));
});

#[track_caller]
fn round_trips(d: Duration) {
    let text = format_duration(d);
    match parse_duration(&text) {
        Ok(back) => assert_eq!(
            back, d,
            "{d:?} formats as {text:?}, which parses as {back:?}"
        ),
        Err(e) => panic!("{d:?} formats as {text:?}, which does not parse: {e}"),
    }
}
