//! Redaction of connection URLs for logs, error messages and `Debug` output: the one place that
//! decides which parts of a database or broker URL are secret.
//!
//! Parsing is the `url` crate's (the parser sqlx and most drivers use), so the user-info and
//! the query are found where the driver finds them, not by splitting on `@` and `:`. Whatever
//! does not parse cleanly is redacted conservatively rather than shown as it is.

use url::{Position, Url};

/// What a secret is replaced by.
const MASK: &str = "***";

/// Schemes whose user-info without a password is itself the secret: NATS reads
/// `nats://TOKEN@host` as token authentication.
const TOKEN_IN_USERNAME: &[&str] = &["nats", "tls", "ws", "wss"];

/// Parameter names (lowercased, percent-decoded, ASCII letters and digits only, so `api_key`,
/// `API-Key` and `apikey` are one name) whose whole value is a secret.
const SECRET_NAMES: &[&str] = &[
    "pass",
    "pwd",
    "key",
    "auth",
    "authorization",
    "sig",
    "jwt",
    "nkey",
    "seed",
    "passphrase",
    "creds",
];

/// Words that make any parameter name containing them secret: `sslpassword`, `client_secret`,
/// `access_token`, `x-amz-security-token`, `aws_secret_access_key`…
const SECRET_WORDS: &[&str] = &[
    "password",
    "passwd",
    "secret",
    "token",
    "credential",
    "signature",
    "apikey",
    "accesskey",
    "privatekey",
];

/// Characters between parameters: URL query separators, and the whitespace of `key=value`
/// connection strings (libpq's `host=db password=…`).
const SEPARATORS: &[char] = &['?', '#', '&', ';', ' ', '\t', '\r', '\n'];

/// `url` with every secret in it replaced by `***`, for logs, error messages and `Debug` output.
///
/// Every crate that shows a database or broker URL goes through this one function.
///
/// - The password of the user-info is replaced and the user name kept
///   (`postgres://app:***@host/db`). For NATS (`nats://`, `tls://`, `ws://`, `wss://`), a user
///   name without a password is a token and is replaced too.
/// - The value of every credential-like query parameter is replaced, wherever it is in the
///   query, whatever its case or percent-encoding: `password`, `pass`, `passwd`, `pwd`,
///   `sslpassword`, `secret`, `client_secret`, `token`, `access_token`, `api_key`/`apikey`,
///   `key`, `auth`, `authorization`, `credentials`, `sig`/`signature`, `jwt`, `nkey`, `seed`,
///   `passphrase`, and any name containing *password*, *secret*, *token*, *credential*,
///   *signature*, *apikey*, *accesskey* or *privatekey*. Other parameters are kept, in order.
///   File paths such as `sslkey`, `sslcert`, `ssl-key` or AMQP's `keyfile` are kept: they name
///   where the key is, which is what an operator debugging TLS needs, and are not the key.
/// - Input that is not a well-formed URL (a Kafka `host:port,host:port` list, a libpq
///   `host=… password=…` string, a password with an unencoded `/`, `?` or `#`) is redacted
///   conservatively: everything before its last `@` except a plain user name, and the value of
///   every credential-like `name=value`. In a libpq `keyword=value …` string an `@` belongs to
///   a value, not to a user-info: a quoted secret is hidden whole, `@` included, and another
///   value holding a URL or an `@` is redacted as a URL of its own. Some passwords cannot be
///   told from a URL: one holding `/`, `?` or `#` and then `name=value@host`
///   (`app:5432/db?x=y@host`, `app:@h?x=y@host`) spells a URL with a user-info or a path and
///   an `@` in a query value, and is shown as that URL, which is how drivers read it too.
///
/// The rest is shown as the `url` crate serializes it, which may differ from the input in
/// encoding details (for example a space in the query becomes `%20`).
///
/// ```
/// use idem_redact::redact_url;
///
/// assert_eq!(redact_url("postgres://app:hunter2@db:5432/pay"), "postgres://app:***@db:5432/pay");
/// assert_eq!(
///     redact_url("postgres://app@db/pay?password=hunter2&application_name=svc@prod"),
///     "postgres://app@db/pay?password=***&application_name=svc@prod",
/// );
/// assert_eq!(redact_url("sqlite:payments.db"), "sqlite:payments.db");
/// assert_eq!(redact_url("nats://s3cr3t-token@127.0.0.1:4222"), "nats://***@127.0.0.1:4222");
/// ```
#[must_use]
pub fn redact_url(url: &str) -> String {
    Url::parse(url)
        .ok()
        .and_then(|parsed| redact_parsed(url, parsed))
        .unwrap_or_else(|| redact_unparsed(url))
}

/// `None` when the parse cannot be trusted to have found the user-info, or it cannot be
/// rewritten; the caller then falls back to [`redact_unparsed`].
fn redact_parsed(input: &str, mut url: Url) -> Option<String> {
    // An `@` after the authority means the parser cut the user-info short (an unencoded `/`,
    // `?` or `#` in a password, or `scheme:user:pw@host` without `//`): the path or the
    // fragment then holds the rest of the secret. In a query value (`application_name=a@b`)
    // it is legitimate and handled parameter by parameter. The path is also read as written:
    // the parser drops dot segments, and the `@` in them (`nats://tok/en@h/..`; found by
    // fuzz/redact_url).
    if url.path().contains('@')
        || written_path(input).contains('@')
        || url.fragment().is_some_and(|f| f.contains('@'))
    {
        return None;
    }
    // `app:12?x=y@host` parses as host `app`, port `12` and a query, and `scheme:app:?pw@host`
    // (no `//`) as the path `app:` and a query: without user-info, and with no path or no
    // host, an `@` in the query may be the end of a password.
    let no_user_info = url.username().is_empty() && url.password().is_none();
    if no_user_info
        && (matches!(url.path(), "" | "/") || url.host().is_none())
        && url.query().is_some_and(|q| q.contains('@'))
    {
        return None;
    }
    if url.password().is_some() {
        url.set_password(Some(MASK)).ok()?;
    } else if !url.username().is_empty() && TOKEN_IN_USERNAME.contains(&url.scheme()) {
        url.set_username(MASK).ok()?;
    }
    let (head, tail) = url.as_str().split_at(url[..Position::AfterPath].len());
    match redact_params(tail) {
        (tail, Tail::Params) => Some(format!("{head}{tail}")),
        (_, Tail::StrayUserInfo) => None,
    }
}

/// The path of `input` as written: after the scheme and the authority (which ends at the
/// first `/`, `\\`, `?` or `#`), up to the query or the fragment. Rough where the parser is
/// subtle (tabs inside `//`), but only ever towards more text than the real path.
fn written_path(input: &str) -> &str {
    let Some((_, rest)) = input.split_once(':') else {
        return "";
    };
    let rest = match rest.strip_prefix("//") {
        Some(authority) => {
            &authority[authority
                .find(['/', '\\', '?', '#'])
                .unwrap_or(authority.len())..]
        }
        None => rest,
    };
    &rest[..rest.find(['?', '#']).unwrap_or(rest.len())]
}

/// What [`redact_params`] found.
#[derive(Debug, PartialEq, Eq)]
enum Tail {
    /// Parameters only.
    Params,
    /// Something with an `@` that is no `name=value`: the rest of a user-info the parser
    /// split early.
    StrayUserInfo,
}

/// Conservative redaction of text that is not a trustworthy URL.
fn redact_unparsed(s: &str) -> String {
    if is_key_values(s) {
        // libpq `host=db password='p@ss'`: an `@` is in a value, not the end of a user-info;
        // taken as one, it would show what follows it (found by fuzz/redact_url).
        return redact_key_values(s);
    }
    let (head, rest) = match s.find("://") {
        Some(i) if is_scheme(&s[..i]) => s.split_at(i + 3),
        _ => ("", s),
    };
    let mut out = String::with_capacity(s.len());
    out.push_str(head);
    let after_userinfo = match rest.rfind('@') {
        Some(at) => {
            // The last `@`, as drivers take it: a password may contain `@`, a host cannot.
            match rest[..at].split_once(':') {
                Some((user, _)) if is_plain_user(user) => {
                    out.push_str(user);
                    out.push(':');
                }
                _ => {}
            }
            out.push_str(MASK);
            out.push('@');
            &rest[at + 1..]
        }
        None => rest,
    };
    let end = after_userinfo
        .find(|c| matches!(c, '/' | '?' | '#') || SEPARATORS.contains(&c))
        .unwrap_or(after_userinfo.len());
    let (authority, after) = after_userinfo.split_at(end);
    if authority.contains('=') {
        // No authority: a `key=value` string.
        out.push_str(&redact_params(after_userinfo).0);
    } else {
        out.push_str(&redact_ports(authority));
        out.push_str(&redact_params(after).0);
    }
    out
}

/// `host:port[,host:port…]` with every port that is not a number masked: without its `@host`,
/// a `user:password` looks like a host and a port.
fn redact_ports(authority: &str) -> String {
    let mut out = String::with_capacity(authority.len());
    for (i, piece) in authority.split(',').enumerate() {
        if i > 0 {
            out.push(',');
        }
        let port_at = if piece.starts_with('[') {
            piece.find("]:").map(|i| i + 2)
        } else {
            piece.rfind(':').map(|i| i + 1)
        };
        match port_at {
            Some(at) if !piece[at..].bytes().all(|b| b.is_ascii_digit()) => {
                out.push_str(&piece[..at]);
                out.push_str(MASK);
            }
            _ => out.push_str(piece),
        }
    }
    out
}

/// Walks `s` piece by piece, the way both the query-like and the `keyword=value` redactions
/// read it: separators are copied as they are; a credential-like `name=value` keeps its name
/// and has its value masked (a quoted value whole, with whatever is glued to its closing
/// quote); every other piece goes to `other`, which writes it to `out`.
fn for_each_piece(s: &str, out: &mut String, mut other: impl FnMut(&str, &mut String)) {
    let mut rest = s;
    loop {
        let start = rest
            .find(|c| !SEPARATORS.contains(&c))
            .unwrap_or(rest.len());
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        if rest.is_empty() {
            return;
        }
        let end = rest.find(SEPARATORS).unwrap_or(rest.len());
        let token = &rest[..end];
        let mut consumed = end;
        match token.split_once('=') {
            Some((name, value)) if !name.contains('@') && is_secret_name(name) => {
                out.push_str(name);
                out.push('=');
                out.push_str(MASK);
                if value.starts_with('\'') {
                    // A quoted value (libpq: `password='a b'`) runs past separators, and
                    // whatever is glued to its closing quote (`'a b'c`) is part of it: shown,
                    // it would be a piece of the secret, and redacting again would change
                    // the output (found by fuzz/redact_url).
                    consumed = quoted_value_end(rest, name.len() + 2);
                }
            }
            _ => other(token, out),
        }
        rest = &rest[consumed..];
    }
}

/// Replaces the value of every credential-like `name=value` in `s`, keeping everything else,
/// separators included, as it is; a piece with an `@` that is no `name=value` is replaced
/// whole.
fn redact_params(s: &str) -> (String, Tail) {
    let mut out = String::with_capacity(s.len());
    let mut found = Tail::Params;
    for_each_piece(s, &mut out, |token, out| match token.split_once('=') {
        Some((name, _)) if !name.contains('@') => out.push_str(token),
        None if !token.contains('@') => out.push_str(token),
        _ => {
            out.push_str(MASK);
            found = Tail::StrayUserInfo;
        }
    });
    (out, found)
}

/// Whether `s` is a `keyword=value …` connection string (libpq): its first piece is a name
/// without the `:`, `/`, `\` or `@` that a scheme, an authority or a user-info needs, and `=`.
fn is_key_values(s: &str) -> bool {
    let first = s.trim_start_matches(SEPARATORS);
    let first = &first[..first.find(SEPARATORS).unwrap_or(first.len())];
    first
        .split_once('=')
        .is_some_and(|(name, _)| !name.is_empty() && !name.contains([':', '/', '\\', '@']))
}

/// [`redact_params`] for a `keyword=value …` string, where an `@` belongs to a value: a
/// value holding a URL or an `@` (`dsn=postgres://app:pw@host`, `user=app@corp`) is redacted
/// as a URL of its own, and any other piece with an `@` is masked whole.
fn redact_key_values(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for_each_piece(s, &mut out, |token, out| match token.split_once('=') {
        // A value that is no `keyword=value` string itself never comes back here.
        Some((name, value))
            if !name.contains('@')
                && (value.contains("://") || value.contains('@'))
                && !is_key_values(value) =>
        {
            out.push_str(name);
            out.push('=');
            out.push_str(&redact_url(value));
        }
        _ if !token.contains('@') => out.push_str(token),
        // The name kept, the text stays a `keyword=value` string when redacted again.
        Some((name, _)) if !name.contains('@') => {
            out.push_str(name);
            out.push('=');
            out.push_str(MASK);
        }
        _ => out.push_str(MASK),
    });
    out
}

/// Where a quoted value whose body starts at `from` ends, with whatever is glued to its
/// closing quote (`'a b'c`): the next separator after the quote, or the end of `s`.
fn quoted_value_end(s: &str, from: usize) -> usize {
    let end = quoted_end(s, from);
    s[end..].find(SEPARATORS).map_or(s.len(), |i| end + i)
}

/// The index just past the closing quote of a quoted value whose body starts at `from`
/// (backslash escapes the next character), or the end of `s` when it is never closed.
fn quoted_end(s: &str, from: usize) -> usize {
    let mut chars = s[from..].char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '\'' => return from + i + 1,
            _ => {}
        }
    }
    s.len()
}

pub(crate) fn is_secret_name(name: &str) -> bool {
    let name = normalized_name(name);
    SECRET_NAMES.contains(&name.as_str()) || SECRET_WORDS.iter().any(|w| name.contains(w))
}

/// Percent-decoded, lowercased, ASCII letters and digits only.
fn normalized_name(name: &str) -> String {
    let bytes = name.as_bytes();
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let mut b = bytes[i];
        if b == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok());
            if let Some(decoded) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                b = decoded;
                i += 2;
            }
        }
        if b.is_ascii_alphanumeric() {
            out.push(char::from(b.to_ascii_lowercase()));
        }
        i += 1;
    }
    out
}

fn is_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// A user name that cannot be part of a secret or a host: unreserved characters and
/// percent-escapes only.
fn is_plain_user(user: &str) -> bool {
    user.chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_' | '~' | '%' | '+'))
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[track_caller]
    fn shows(input: &str, expected: &str) {
        assert_eq!(redact_url(input), expected, "redact_url({input:?})");
    }

    /// Every piece of `secret` longer than three characters is absent from the redaction.
    #[track_caller]
    fn hides(input: &str, secret: &str) {
        let shown = redact_url(input);
        for len in 4..=secret.len() {
            for piece in secret.as_bytes().windows(len) {
                let piece = String::from_utf8_lossy(piece);
                assert!(
                    !shown.contains(piece.as_ref()),
                    "redact_url({input:?}) = {shown:?} shows {piece:?} of the secret"
                );
            }
        }
    }

    #[test]
    fn password_in_the_query_without_user_info_password_is_redacted() {
        shows(
            "postgres://app@host/db?password=x",
            "postgres://app@host/db?password=***",
        );
    }

    #[test]
    fn at_sign_in_a_query_value_keeps_host_and_query() {
        shows(
            "postgres://app:pw@host/db?application_name=svc@prod",
            "postgres://app:***@host/db?application_name=svc@prod",
        );
    }

    #[test]
    fn credential_parameters_are_redacted_and_the_others_kept_in_order() {
        shows(
            "postgres://app:pw@host:5432/db?sslmode=require&password=x&application_name=a\
             &PassWord=y&connect_timeout=5&sslpassword=z&sslkey=/etc/app/key.pem",
            "postgres://app:***@host:5432/db?sslmode=require&password=***&application_name=a\
             &PassWord=***&connect_timeout=5&sslpassword=***&sslkey=/etc/app/key.pem",
        );
        shows(
            "redis+unix:///run/redis.sock?db=1&user=app&pass=hunter2",
            "redis+unix:///run/redis.sock?db=1&user=app&pass=***",
        );
        shows(
            "https://api.example/v1?api_key=a&API-KEY=b&token=c&access_token=d&secret=e\
             &client_secret=f&auth=g&credentials=h&key=i&pwd=j&passwd=k&page=2",
            "https://api.example/v1?api_key=***&API-KEY=***&token=***&access_token=***\
             &secret=***&client_secret=***&auth=***&credentials=***&key=***&pwd=***\
             &passwd=***&page=2",
        );
        // Repeated, empty and value-less parameters, and a fragment.
        shows(
            "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10&auth_mechanism=plain&password=&flag#token=abc",
            "amqp://guest:***@127.0.0.1:5672/%2f?heartbeat=10&auth_mechanism=plain&password=***&flag#token=***",
        );
    }

    #[test]
    fn ipv6_host_is_kept() {
        shows(
            "mysql://root:pw@[::1]:3306/test?ssl-mode=required&password=pw2",
            "mysql://root:***@[::1]:3306/test?ssl-mode=required&password=***",
        );
        shows(
            "postgres://app:pw@[fe80::1]/db?application_name=svc@prod",
            "postgres://app:***@[fe80::1]/db?application_name=svc@prod",
        );
    }

    #[test]
    fn percent_encoded_secrets_are_redacted() {
        shows(
            "postgres://app:p%40ss%3Aw%2Frd@host/db?pass%77ord=p%40ss&application_name=a@b",
            "postgres://app:***@host/db?pass%77ord=***&application_name=a@b",
        );
        hides(
            "postgres://app:p%40ss%3Aw%2Frd@host/db?pass%77ord=p%40ss&application_name=a@b",
            "p%40ss%3Aw%2Frd",
        );
    }

    #[test]
    fn urls_without_user_info_are_unchanged_but_for_secrets() {
        shows("mysql://127.0.0.1:3306/test", "mysql://127.0.0.1:3306/test");
        shows("postgres://app@host/db", "postgres://app@host/db");
        shows(
            "postgres://host:5432/db?application_name=svc@prod",
            "postgres://host:5432/db?application_name=svc@prod",
        );
        shows(
            "postgres://host/db?sslmode=require&password=x",
            "postgres://host/db?sslmode=require&password=***",
        );
    }

    #[test]
    fn nats_token_in_the_user_name_is_redacted() {
        shows("nats://s3cr3t@127.0.0.1:4222", "nats://***@127.0.0.1:4222");
        shows(
            "nats://app:pw@127.0.0.1:4222",
            "nats://app:***@127.0.0.1:4222",
        );
        shows("nats://127.0.0.1:4222", "nats://127.0.0.1:4222");
        // Elsewhere a lone user name is just a name.
        shows(
            "redis://:pw@127.0.0.1:6379/0",
            "redis://:***@127.0.0.1:6379/0",
        );
        shows("mqtt://app@127.0.0.1:1883", "mqtt://app@127.0.0.1:1883");
    }

    #[test]
    fn non_urls_are_shown_without_secrets() {
        // Nothing secret: shown as given.
        shows("sqlite:payments.db", "sqlite:payments.db");
        shows(
            "sqlite:///var/lib/app/idem.db",
            "sqlite:///var/lib/app/idem.db",
        );
        shows("127.0.0.1:9092,h2:9092", "127.0.0.1:9092,h2:9092");
        shows(
            "kafka://h1:9092,[::1]:9092,h3",
            "kafka://h1:9092,[::1]:9092,h3",
        );
        shows("not a url", "not a url");
        shows("", "");
        // Credentials in text that is no URL at all.
        shows("app:hunter2@127.0.0.1:9092", "app:***@127.0.0.1:9092");
        // A forgotten `@host` leaves the password where a port should be.
        shows("mqtt://app:hunter2", "mqtt://app:***");
        shows("127.0.0.1:9092,app:hunter2", "127.0.0.1:9092,app:***");
        shows(
            "host=db user=app password='hunter 2' dbname=pay",
            "host=db user=app password=*** dbname=pay",
        );
        shows(
            "sqlite:payments.db?key=hunter2&mode=rwc",
            "sqlite:payments.db?key=***&mode=rwc",
        );
        // Several hosts (libpq) are no single authority the parser accepts.
        shows(
            "postgres://app:hunter2@h1:5432,h2:5432/db?password=x",
            "postgres://app:***@h1:5432,h2:5432/db?password=***",
        );
    }

    #[test]
    fn an_at_sign_in_a_key_value_string_is_no_user_info() {
        shows("sig='u@hunter2\t'", "sig=***");
        shows(
            "x-amz-security-token='@hunter2'",
            "x-amz-security-token=***",
        );
        shows("pass%77ord=':@hunter2'", "pass%77ord=***");
        shows(
            "host=db user=app password='p@ss word' dbname=pay",
            "host=db user=app password=*** dbname=pay",
        );
        hides("host=db password=hunter@2x2x", "hunter@2x2x");
        // A value that holds a URL or an `@` is redacted as a URL.
        shows(
            "dsn=postgres://app:hunter2@db/pay sslmode=require",
            "dsn=postgres://app:***@db/pay sslmode=require",
        );
        shows("host=db user=app@corp", "host=db user=***@corp");
        for input in [
            ";A=\0a://ss\0@\0",
            "a=b=c@d",
            "user=app:pw@corp",
            "99=h=l`\0%//@p?ass=h`\0@@@@@",
        ] {
            let once = redact_url(input);
            assert_eq!(redact_url(&once), once, "{input:?}");
        }
    }

    #[test]
    fn text_glued_to_a_quoted_secret_is_redacted_with_it() {
        shows("pwd='hunter2'a", "pwd=***");
        shows(
            "host=db password='hunter 2'x2 dbname=pay",
            "host=db password=*** dbname=pay",
        );
        for input in ["pwd='hunter2'a", "password='a b'c&d=1"] {
            let once = redact_url(input);
            assert_eq!(redact_url(&once), once, "{input:?}");
        }
    }

    #[test]
    fn a_password_the_parser_would_split_early_is_not_shown() {
        // Unencoded `/`, `#`, `?` and `@` in passwords, and a URL missing its `//`.
        for (input, secret) in [
            ("postgres://app:hun/ter2@host/db", "hun/ter2"),
            ("postgres://app:12#hunter2@host/db", "12#hunter2"),
            ("postgres://app:12?hunter2@host/db", "12?hunter2"),
            ("postgres://app:12?x=hunter2@host/db", "12?x=hunter2"),
            ("postgres://app:a@b?hunter2@host/db", "a@b?hunter2"),
            ("postgres://app:hun@ter2@host/db", "hun@ter2"),
            ("postgres:app:hunter2@host/db", "hunter2"),
            ("postgres:app:?hunter2=@host/db", "?hunter2="),
            ("nats://hunter/2x2x@host/..", "hunter/2x2x"),
            ("wss://hunter2x\\2x@a/..", "hunter2x\\2x"),
            (
                "postgres://app:hunter2@h1,h2/db?application_name=svc@prod",
                "hunter2",
            ),
        ] {
            hides(input, secret);
            assert!(
                redact_url(input).contains("***"),
                "{input:?} -> {}",
                redact_url(input)
            );
        }
        for input in [
            "postgres://app:hun/ter2@host/db",
            "postgres://app:12#hunter2@host/db",
            "postgres://app:12?hunter2@host/db",
            "postgres://app:12?x=hunter2@host/db",
            "postgres://app:a@b?hunter2@host/db",
        ] {
            shows(input, "postgres://app:***@host/db");
        }
    }
}
