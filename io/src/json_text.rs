//! JSON string literals written by hand, for text that is assembled without a
//! JSON library on paths that must not allocate a `Value` (log lines, the
//! lookup-hash log).

use std::fmt::Write;

/// What to do with characters outside ASCII.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NonAscii {
    /// Written as they are (UTF-8), as are DEL and the rest of printable ASCII.
    Keep,
    /// Written as `\uXXXX` escapes (UTF-16 units), DEL included: Python's
    /// `json.dumps` with its default `ensure_ascii=True`.
    Escape,
}

/// Appends `s` to `out` as a quoted JSON string. `"`, `\` and every control
/// character are escaped, with the short forms (`\n`, `\t`, ...) where JSON has
/// one, as Python writes them.
pub fn push_string(out: &mut String, s: &str, non_ascii: NonAscii) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            c if (c as u32) >= 0x7f && non_ascii == NonAscii::Keep => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(s: &str, n: NonAscii) -> String {
        let mut out = String::new();
        push_string(&mut out, s, n);
        out
    }

    #[test]
    fn escapes() {
        for n in [NonAscii::Keep, NonAscii::Escape] {
            assert_eq!(json("plain", n), r#""plain""#);
            assert_eq!(json(r#"say "hi" \ bye"#, n), r#""say \"hi\" \\ bye""#);
            assert_eq!(json("a\nb\rc\td", n), r#""a\nb\rc\td""#);
            assert_eq!(json("\u{08}\u{0c}\u{00}\u{1f}", n), r#""\b\f\u0000\u001f""#);
        }
        assert_eq!(json("\u{7f}é→🦀", NonAscii::Keep), "\"\u{7f}é→🦀\"");
        assert_eq!(
            json("\u{7f}é→🦀", NonAscii::Escape),
            r#""\u007f\u00e9\u2192\ud83e\udd80""#
        );
    }
}
