//! Secrets in a client's `name = value` settings (librdkafka's `sasl.password`, say), by the
//! same names that make a URL's query parameter secret.

use crate::redact::is_secret_name;

/// Words that make a client setting secret beyond the URL parameter names: librdkafka's
/// `ssl.key.*` (the key itself, its password, where it is) and `sasl.oauthbearer.*` (client
/// secrets, token endpoints with credentials). Matched like the URL names: lowercased, letters
/// and digits only.
const SECRET_SETTING_WORDS: &[&str] = &["sslkey", "sasloauthbearer"];

/// `value`, or `***` when `name` names a secret: every name [`redact_url`](crate::redact_url)
/// hides in a query (`password`, `sasl.password`, `ssl.keystore.password`, `*.secret`,
/// `*token*`, …), plus `ssl.key.*` and `sasl.oauthbearer.*`.
///
/// ```
/// use idem_redact::redact_setting;
///
/// assert_eq!(redact_setting("sasl.password", "hunter2"), "***");
/// assert_eq!(redact_setting("ssl.key.pem", "-----BEGIN PRIVATE KEY-----"), "***");
/// assert_eq!(redact_setting("bootstrap.servers", "k1:9092"), "k1:9092");
/// ```
#[must_use]
pub fn redact_setting<'a>(name: &str, value: &'a str) -> &'a str {
    let normalized: String = name
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    if is_secret_name(name) || SECRET_SETTING_WORDS.iter().any(|w| normalized.contains(w)) {
        "***"
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::redact_setting;

    #[test]
    fn librdkafka_secrets_are_hidden_and_the_rest_shown() {
        for name in [
            "sasl.password",
            "SASL.Password",
            "ssl.key.password",
            "ssl.key.pem",
            "ssl.key.location",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
            "some.token",
            "api_key",
        ] {
            assert_eq!(redact_setting(name, "hunter2"), "***", "{name}");
        }
        for name in [
            "bootstrap.servers",
            "sasl.username",
            "sasl.mechanism",
            "security.protocol",
            "session.timeout.ms",
            "ssl.ca.location",
        ] {
            assert_eq!(redact_setting(name, "value"), "value", "{name}");
        }
    }
}
