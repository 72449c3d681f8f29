//! What Postgres can store: the one rule every text and JSON value passes on its way to the
//! database.
//!
//! Postgres refuses exactly one thing a Rust string can hold: the NUL character (in `text`,
//! and as `\u0000` in `jsonb`). Sandboxes and clients can put NUL anywhere — an exception
//! message, a display output, a file name in a serde error, a message id — so every value the
//! stores write is made storable here, and a hostile byte can never make a commit or a
//! rejection fail. NUL becomes U+FFFD, the replacement character, as invalid UTF-8 already does
//! on its way in (lone surrogates cannot reach Rust strings; the driver and serde replace them).

use std::borrow::Cow;

use serde::Serialize;
use serde_json::Value;

/// The replacement for a character Postgres cannot store.
pub const REPLACEMENT: char = '\u{FFFD}';

/// `s`, storable in a Postgres `text` column.
pub fn text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// `value` as JSON storable in a Postgres `jsonb` column: every string and every object key
/// made storable.
pub fn json<T: Serialize + ?Sized>(value: &T) -> serde_json::Result<Value> {
    let mut v = serde_json::to_value(value)?;
    fix(&mut v);
    Ok(v)
}

fn fix(v: &mut Value) {
    match v {
        Value::String(s) => {
            if s.contains('\0') {
                *s = s.replace('\0', "\u{FFFD}");
            }
        }
        Value::Array(items) => items.iter_mut().for_each(fix),
        Value::Object(map) => {
            if map.keys().any(|k| k.contains('\0')) {
                let old = std::mem::take(map);
                for (k, mut item) in old {
                    fix(&mut item);
                    map.insert(text(&k).into_owned(), item);
                }
            } else {
                map.values_mut().for_each(fix);
            }
        }
        Value::Null | Value::Bool(_) | Value::Number(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_is_replaced_in_text_and_in_every_json_string_and_key() {
        assert_eq!(text("a\0b"), "a\u{FFFD}b");
        assert!(matches!(text("clean"), Cow::Borrowed(_)));
        let v = json(&serde_json::json!({"k\0": ["x\0", {"y": "z\0"}], "n": 1})).unwrap();
        assert_eq!(v, serde_json::json!({"k\u{FFFD}": ["x\u{FFFD}", {"y": "z\u{FFFD}"}], "n": 1}));
        assert!(!v.to_string().contains("\\u0000"));
    }
}
