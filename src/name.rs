//! Image names and their on-disk encoding.
//!
//! - A name follows container image references (`alpine:3.17`, `registry.example:5000/team/app:v1`,
//!   `app@sha256:…`).
//! - ENC replaces `/` with `%` and `:` with `+`, Charliecloud's mapping, so both tools name the
//!   same directory; `%` and `+` are not allowed in names, so decoding is exact.
//! - An [`ImageName`] is always valid; ENC is one path component, neither `.` nor `..`: joined to a
//!   directory it never escapes it.

use std::fmt;

/// The longest encoded name accepted, in bytes (the usual NAME_MAX).
pub const MAX_ENCODED_LEN: usize = 255;

/// Why a name was rejected. Each variant is one rule of the contract, its message naming the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameRule {
    #[error("the name is empty")]
    Empty,
    #[error("the name is not valid UTF-8")]
    NotUtf8,
    #[error("the name is {0} bytes long once encoded; the limit is {MAX_ENCODED_LEN}")]
    TooLong(usize),
    #[error("a name may not start with '{0}'")]
    LeadingChar(char),
    #[error("a name may not contain '//'")]
    DoubleSlash,
    #[error("a name may not end with '/'")]
    TrailingSlash,
    #[error("a name may not contain a '{0}' path component")]
    DotComponent(&'static str),
    #[error("a name may not contain '{0}' (reserved for the encoded form)")]
    Reserved(char),
    #[error("a name may not contain whitespace")]
    Whitespace,
    #[error("a name may not contain control characters")]
    Control,
    #[error(
        "a name may not contain '{}' (allowed: ASCII letters, digits, '.', '_', '-', '/', ':', '@')",
        crate::ident::printable(&.0.to_string())
    )]
    NotAllowed(char),
    #[error("no image's tree is named with '{0}' (in tree names ':' is written '+', '/' '%')")]
    NotEncoded(char),
}

/// A rejected name together with the rule it broke.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid image name '{}': {rule}", crate::ident::printable(name))]
pub struct InvalidName {
    pub name: String,
    pub rule: NameRule,
}

/// A valid image name and its encoded file name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageName {
    // Field order matters for the derived `Ord`: the lock order is ascending ENC, and ENC is a
    // bijection of the name, so sorting by it is total.
    enc: String,
    name: String,
}

impl ImageName {
    /// Validates `name` against the contract's rules.
    pub fn parse(name: &str) -> Result<Self, InvalidName> {
        check(name).map_err(|rule| InvalidName {
            name: name.to_owned(),
            rule,
        })?;
        Ok(ImageName {
            enc: name.replace('/', "%").replace(':', "+"),
            name: name.to_owned(),
        })
    }

    /// Validates a raw command-line argument, which may not be UTF-8.
    pub fn parse_os(name: &std::ffi::OsStr) -> Result<Self, InvalidName> {
        match name.to_str() {
            Some(s) => Self::parse(s),
            None => Err(InvalidName {
                name: name.to_string_lossy().into_owned(),
                rule: NameRule::NotUtf8,
            }),
        }
    }

    /// Decodes a file name found in an images directory; a name that is not valid (no image stowage
    /// can manage) returns the rule it broke.
    pub fn from_encoded(enc: &str) -> Result<Self, InvalidName> {
        let name = enc.replace('%', "/").replace('+', ":");
        // A '/' or ':' in ENC would decode to itself and not round-trip.
        if let Some(c) = enc.chars().find(|c| *c == '/' || *c == ':') {
            return Err(InvalidName {
                name,
                rule: NameRule::NotEncoded(c),
            });
        }
        Self::parse(&name)
    }

    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// The encoded form: the image's directory and lock file name.
    pub fn encoded(&self) -> &str {
        &self.enc
    }
}

impl fmt::Display for ImageName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

fn check(name: &str) -> Result<(), NameRule> {
    let first = name.chars().next().ok_or(NameRule::Empty)?;
    // Character rules first: they are the most specific message for names like "a b" or "x%y".
    for c in name.chars() {
        match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' | '-' | '/' | ':' | '@' => {}
            '%' | '+' => return Err(NameRule::Reserved(c)),
            c if c.is_whitespace() => return Err(NameRule::Whitespace),
            c if c.is_control() => return Err(NameRule::Control),
            c => return Err(NameRule::NotAllowed(c)),
        }
    }
    if matches!(first, '.' | '-' | '/') {
        return Err(NameRule::LeadingChar(first));
    }
    if name.contains("//") {
        return Err(NameRule::DoubleSlash);
    }
    // `q/` would be an image distinct from `q` (ENC `q%`): an empty last component, like `//`.
    if name.ends_with('/') {
        return Err(NameRule::TrailingSlash);
    }
    let dot = |c: &str| [".", ".."].into_iter().find(|d| *d == c);
    if let Some(dot) = name.split('/').find_map(dot) {
        return Err(NameRule::DotComponent(dot));
    }
    // Encoding maps one ASCII byte to one, so the encoded length is the name's length.
    if name.len() > MAX_ENCODED_LEN {
        return Err(NameRule::TooLong(name.len()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str) -> NameRule {
        ImageName::parse(name).unwrap_err().rule
    }

    #[test]
    fn accepts_references_and_encodes_them_like_charliecloud() {
        for (name, enc) in [
            ("alpine", "alpine"),
            ("alpine:3.17", "alpine+3.17"),
            (
                "registry.example:5000/team/app:v1",
                "registry.example+5000%team%app+v1",
            ),
            ("app@sha256:0123456789abcdef", "app@sha256+0123456789abcdef"),
            ("a", "a"),
            ("x.y_z-w", "x.y_z-w"),
            ("team/app:v1", "team%app+v1"),
            ("a..b", "a..b"),
            ("a/.b", "a%.b"),
            ("a/b/c:d@sha256:ff", "a%b%c+d@sha256+ff"),
        ] {
            let n = ImageName::parse(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(n.encoded(), enc);
            let back = ImageName::from_encoded(enc).unwrap();
            assert_eq!(back, n);
            assert_eq!(back.as_str(), name);
        }
    }

    #[test]
    fn rejects_undecodable_file_names() {
        for enc in ["has space", ".hidden", "a:b", "%lead", "q%"] {
            assert!(ImageName::from_encoded(enc).is_err(), "{enc:?}");
        }
        // Said as a tree's name, not as an image's (whose ':' is allowed).
        let e = ImageName::from_encoded("a::b").unwrap_err();
        assert_eq!(e.rule, NameRule::NotEncoded(':'));
    }

    #[test]
    fn each_broken_rule_is_named() {
        use NameRule::*;
        assert!(ImageName::parse(&"a".repeat(255)).is_ok());
        let long = "a".repeat(256);
        for (name, broken) in [
            ("", Empty),
            (long.as_str(), TooLong(256)),
            (".alpine", LeadingChar('.')),
            ("-alpine", LeadingChar('-')),
            ("/alpine", LeadingChar('/')),
            ("team//app", DoubleSlash),
            ("q/", TrailingSlash),
            ("team/app/", TrailingSlash),
            ("team/./app", DotComponent(".")),
            ("team/../app", DotComponent("..")),
            ("team/..", DotComponent("..")),
            ("a/.", DotComponent(".")),
            ("a%b", Reserved('%')),
            ("a+b", Reserved('+')),
            ("a b", Whitespace),
            ("a\tb", Whitespace),
            ("a\nb", Whitespace),
            ("a\u{1}b", Control),
            ("a\u{7f}b", Control),
            ("a*b", NotAllowed('*')),
            ("café", NotAllowed('é')),
            ("a\\b", NotAllowed('\\')),
        ] {
            assert_eq!(rule(name), broken, "{name:?}");
        }
        use std::os::unix::ffi::OsStrExt;
        let raw = std::ffi::OsStr::from_bytes(b"a\xffb");
        assert_eq!(ImageName::parse_os(raw).unwrap_err().rule, NotUtf8);
    }

    #[test]
    fn messages_name_the_rule() {
        let e = ImageName::parse("a b").unwrap_err().to_string();
        assert!(e.contains("'a b'") && e.contains("whitespace"), "{e}");
    }

    #[test]
    fn order_is_by_encoded_name() {
        // ':' (0x3a) sorts after '.', but its encoding '+' (0x2b) before it: the order follows ENC,
        // as every process sorts.
        let mut v = [
            ImageName::parse("a.b").unwrap(),
            ImageName::parse("a:b").unwrap(),
        ];
        v.sort();
        assert_eq!(v[0].as_str(), "a:b");
    }
}
