//! `redact_url`: every database and broker URL shown in a log, an error or a `Debug` goes
//! through it.
//!
//! - Any text: no panic, and redaction settles: `redact(redact(s))` is `redact(s)`, or that
//!   same URL as the `url` crate serializes it, or at least a fixed point itself (text the
//!   conservative fallback redacted may parse as a URL the second time, and be redacted a bit
//!   more, never less). Not checked when the output holds a tab or a line break, which the
//!   URL parser deletes, joining the pieces around them into other text.
//! - URLs built around a known secret, from structured input: the user-info password, a NATS
//!   token user name, the value of a credential-like query parameter and the value of a
//!   credential-like libpq `key=value` never appear in the output, whatever surrounds them
//!   (unencoded `@ / ? # :`, percent-escapes, quotes, several hosts…).
#![no_main]

use arbitrary::Arbitrary;
use idem_redact::redact_url;
use libfuzzer_sys::fuzz_target;

/// The secret. Its letters occur in no credential-like parameter name and in none of the
/// generated surroundings, so it can only reach the output from where it was put.
const SECRET: &str = "qxmqxmq";

/// What the surroundings are made of: URL delimiters, percent signs and hex digits,
/// whitespace, quotes, and letters (not those of [`SECRET`]).
const ALPHABET: &[u8] =
    b"abcdefghijklnoprstuvwyzABDEHKPSTW0123456789:/@?#&=;%[]. +-_~!$'\"()*,\\\t\n\r<>^`{|}";

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    raw: &'a str,
    shape: Shape,
}

/// Text drawn from [`ALPHABET`].
#[derive(Debug)]
struct Text(String);

impl<'a> Arbitrary<'a> for Text {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        let bytes: Vec<u8> = u.arbitrary()?;
        Ok(Text(
            bytes
                .iter()
                .map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()]))
                .collect(),
        ))
    }
}

const SCHEMES: &[&str] = &[
    "postgres",
    "postgresql",
    "mysql",
    "mariadb",
    "sqlite",
    "redis",
    "rediss",
    "redis+unix",
    "amqp",
    "amqps",
    "mqtt",
    "tcp",
    "kafka",
    "http",
    "https",
    "file",
    "x",
];
const NATS_SCHEMES: &[&str] = &["nats", "tls", "ws", "wss"];
const SECRET_NAMES: &[&str] = &[
    "password",
    "pass",
    "passwd",
    "pwd",
    "sslpassword",
    "secret",
    "client_secret",
    "token",
    "access_token",
    "api_key",
    "apikey",
    "API-Key",
    "key",
    "auth",
    "authorization",
    "credentials",
    "sig",
    "signature",
    "jwt",
    "nkey",
    "seed",
    "passphrase",
    "creds",
    "x-amz-security-token",
    "aws_secret_access_key",
    "PassWord",
    "pass%77ord",
];

#[derive(Arbitrary, Debug)]
enum Shape {
    /// `scheme:[//]user:PASSWORD@host…`, the password holding the secret.
    UserInfo {
        scheme: u8,
        slashes: bool,
        user: Text,
        before: Text,
        after: Text,
        host: Text,
        rest: Text,
    },
    /// `nats://TOKEN@host…`: a lone user name that is a token.
    Token {
        scheme: u8,
        before: Text,
        after: Text,
        host: Text,
        rest: Text,
    },
    /// `scheme://authority?…&NAME=SECRET…`.
    Param {
        scheme: u8,
        authority: Text,
        path: Text,
        before: Vec<(Text, Text)>,
        separator: u8,
        name: u8,
        after: Text,
    },
    /// libpq `key=value …`: `host=db password=SECRET`, maybe quoted.
    KeyValue {
        before: Vec<(Lower, Text)>,
        name: u8,
        quoted: Option<(Text, Text)>,
        after: Text,
    },
}

/// A libpq keyword: lowercase letters and `_`.
#[derive(Debug)]
struct Lower(String);

impl<'a> Arbitrary<'a> for Lower {
    fn arbitrary(u: &mut arbitrary::Unstructured<'a>) -> arbitrary::Result<Self> {
        const KEY: &[u8] = b"abcdefghijklnoprstuvwyz_";
        let len = u.int_in_range(1..=12)?;
        (0..len)
            .map(|_| Ok(char::from(*u.choose(KEY)?)))
            .collect::<arbitrary::Result<String>>()
            .map(Lower)
    }
}

fn pick<'s>(list: &[&'s str], i: u8) -> &'s str {
    list[usize::from(i) % list.len()]
}

impl Shape {
    fn url(&self) -> String {
        match self {
            Shape::UserInfo {
                scheme,
                slashes,
                user,
                before,
                after,
                host,
                rest,
            } => format!(
                "{}:{}{}:{}{SECRET}{}@{}{}",
                pick(SCHEMES, *scheme),
                if *slashes { "//" } else { "" },
                // `/ ? # \` end the authority before any `:` in the user name: what follows is
                // no password to any parser (libpq's included). In the password they are
                // what the conservative fallback is for.
                user.0.replace(['/', '?', '#', '\\'], ""),
                before.0,
                after.0,
                host.0,
                rest.0
            ),
            Shape::Token {
                scheme,
                before,
                after,
                host,
                rest,
            } => format!(
                "{}://{}{SECRET}{}@{}{}",
                pick(NATS_SCHEMES, *scheme),
                // Before the secret, these would end the authority: no token follows.
                before.0.replace(['/', '?', '#', '\\'], ""),
                // A `:` after the secret and before the authority's last `@` would make it a
                // user name, which is shown: none in the rest of the authority.
                after.0.replace(':', ""),
                host.0.replace([':', '/', '?', '#', '\\'], ""),
                match rest.0.chars().next() {
                    Some('/' | '?' | '#') | None => rest.0.clone(),
                    Some(_) => format!("/{}", rest.0),
                }
            ),
            Shape::Param {
                scheme,
                authority,
                path,
                before,
                separator,
                name,
                after,
            } => {
                let mut url = format!("{}://{}/{}?", pick(SCHEMES, *scheme), authority.0, path.0);
                for (k, v) in before {
                    url.push_str(&format!("{}={}&", k.0, v.0));
                }
                url.push(char::from(b"&;?"[usize::from(*separator) % 3]));
                url.push_str(&format!(
                    "{}={SECRET}{}",
                    pick(SECRET_NAMES, *name),
                    after.0
                ));
                url
            }
            Shape::KeyValue {
                before,
                name,
                quoted,
                after,
            } => {
                let mut s = String::new();
                for (k, v) in before {
                    s.push_str(&format!(
                        "{}={} ",
                        k.0,
                        v.0.replace([' ', '\t', '\r', '\n'], "")
                    ));
                }
                s.push_str(pick(SECRET_NAMES, *name));
                s.push('=');
                match quoted {
                    // Inside quotes, before the secret, a quote or a backslash would end or
                    // shift the quoted value: not what this shape is about.
                    Some((pre, post)) => s.push_str(&format!(
                        "'{}{SECRET}{}'",
                        pre.0.replace(['\'', '\\'], ""),
                        post.0
                    )),
                    None => s.push_str(SECRET),
                }
                s.push_str(&after.0);
                s
            }
        }
    }
}

/// How the URL parser may rewrite text: tabs and newlines removed, percent-escapes decoded,
/// letters lowercased.
fn normalized(s: &str) -> String {
    let s: Vec<u8> = s
        .bytes()
        .filter(|b| !matches!(b, b'\t' | b'\n' | b'\r'))
        .collect();
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' {
            if let Some(b) = s
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(s[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).to_ascii_lowercase()
}

/// `redact_url(once)` is `once`, up to the `url` crate's serialization, or a fixed point.
#[track_caller]
fn idempotent(input: &str, once: &str) {
    if once.contains(['\t', '\r', '\n']) {
        return;
    }
    let twice = redact_url(once);
    let normalized = || url::Url::parse(once).ok().map(String::from);
    assert!(
        twice == once
            || normalized().as_deref() == Some(twice.as_str())
            || redact_url(&twice) == twice,
        "redaction does not settle on {input:?}: {once:?}, {twice:?}, {:?}",
        redact_url(&twice)
    );
}

fuzz_target!(|input: Input| {
    idempotent(input.raw, &redact_url(input.raw));

    let url = input.shape.url();
    // A password holding `/ ? #` and then `name=value@host` spells, as text, a URL with a
    // user-info or a path and an `@` in a query value (`app:5432/db?x=y@host`,
    // `app:@h?x=y@host`): `redact_url` is documented to read it as that URL, as drivers do.
    if let (Shape::UserInfo { .. } | Shape::Token { .. }, Ok(parsed)) =
        (&input.shape, url::Url::parse(&url))
    {
        let holds = |part: Option<&str>| part.is_some_and(|p| normalized(p).contains(SECRET));
        let in_query = holds(parsed.query());
        let user_info = !parsed.username().is_empty() || parsed.password().is_some();
        if in_query && parsed.host().is_some() && (user_info || !matches!(parsed.path(), "" | "/"))
        {
            return;
        }
        // The same form where the secret itself comes out as the host or the path: a `/`,
        // `?` or `#` ended the authority before the `@` meant to close the user-info (an `@`
        // before the secret too, `app:@SECRET?x=y@host`, or a token holding `/`,
        // `nats://SECRET/x?y@host`). Every parser (libpq's first `@`, WHATWG's last `@` of the
        // authority) reads it so; that `@` is in the query or fragment.
        let at_after = parsed.query().is_some_and(|q| q.contains('@'))
            || parsed.fragment().is_some_and(|f| f.contains('@'));
        if at_after && (holds(parsed.host_str()) || holds(Some(parsed.path()))) {
            return;
        }
    }
    // The surroundings may spell the secret only through escapes: then it is not one secret.
    if normalized(&url).matches(SECRET).count() != 1 {
        return;
    }
    let shown = redact_url(&url);
    assert!(
        !normalized(&shown).contains(SECRET),
        "redact_url({url:?}) = {shown:?} shows the secret"
    );
    idempotent(&url, &shown);
});
