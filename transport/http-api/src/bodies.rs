//! Request bodies as lmcache 0.5.6 reads them: Python's `json.loads`, the
//! pydantic models of `/cache/clear` and `/cache/checksums` (FastAPI's 422 with
//! each field's error) and the hand-written checks of `PUT /quota/{salt}`.

use http::StatusCode;
use serde_json::{json, Map, Value};

/// A body refused before the server is asked: the status and the JSON answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub status: StatusCode,
    pub body: Value,
}

impl Rejection {
    /// FastAPI's `HTTPException` shape: `{"detail": msg}`.
    pub fn detail(status: StatusCode, msg: &str) -> Rejection {
        Rejection {
            status,
            body: json!({ "detail": msg }),
        }
    }

    /// FastAPI's validation error: 422 `{"detail": [{type, loc, msg, input}, ...]}`.
    fn validation(errors: Vec<Value>) -> Rejection {
        Rejection {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            body: json!({ "detail": errors }),
        }
    }
}

/// `POST /cache/checksums`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Checksums {
    pub instance_id: i64,
    /// May be empty: 0.5.6 refuses that (400) only once it has found the
    /// instance (else 404), and so does the front.
    pub block_ids: Vec<i64>,
    /// 0 for an absent or non-positive `chunk_size`, refused as an empty
    /// `block_ids` is.
    pub chunk_size_blocks: usize,
    pub layerwise: bool,
}

/// `json.loads`: like serde_json, plus Python's bare `NaN`, `Infinity` and
/// `-Infinity`, which are turned into strings that read back as the same floats
/// wherever 0.5.6 then calls `float()`.
fn python_json(body: &[u8]) -> Result<Value, serde_json::Error> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(v),
        Err(first) => {
            let Ok(text) = std::str::from_utf8(body) else {
                return Err(first);
            };
            match quote_nonfinite_literals(text) {
                Some(fixed) => serde_json::from_str(&fixed).map_err(|_| first),
                None => Err(first),
            }
        }
    }
}

/// Rewrites bare `NaN` / `Infinity` / `-Infinity` tokens outside strings into quoted
/// strings; `None` if there were none.
fn quote_nonfinite_literals(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len() + 8);
    let mut in_string = false;
    let mut escaped = false;
    let mut changed = false;
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else {
            let token = ["-Infinity", "Infinity", "NaN"]
                .into_iter()
                .find(|t| rest.starts_with(t));
            if let Some(t) = token {
                out.push('"');
                out.push_str(t);
                out.push('"');
                rest = &rest[t.len()..];
                changed = true;
                continue;
            }
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    changed.then_some(out)
}

/// `float(x)` for a JSON value, as `PUT /quota` applies it.
fn python_float(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Bool(b) => Some(if *b { 1.0 } else { 0.0 }),
        Value::String(s) => python_float_str(s),
        _ => None,
    }
}

/// Python's `float(str)`: surrounding whitespace, `_` between digits, `inf`/`nan`.
fn python_float_str(s: &str) -> Option<f64> {
    let s = s.trim();
    let b = s.as_bytes();
    let mut cleaned = String::with_capacity(s.len());
    for (i, &c) in b.iter().enumerate() {
        if c == b'_' {
            let digit_before = i > 0 && b[i - 1].is_ascii_digit();
            let digit_after = b.get(i + 1).is_some_and(u8::is_ascii_digit);
            if !(digit_before && digit_after) {
                return None;
            }
            continue;
        }
        cleaned.push(c as char);
    }
    // Rust's grammar (sign, digits, '.', exponent, inf/infinity/nan in any case) is
    // Python's once the underscores are gone.
    cleaned.parse::<f64>().ok()
}

/// `PUT /quota/{salt}`'s hand-written checks, with 0.5.6's messages.
pub fn parse_limit_gb(body: &[u8]) -> Result<f64, &'static str> {
    let v = python_json(without_bom(body)).map_err(|_| "invalid JSON body")?;
    let Some(raw) = v.as_object().and_then(|o| o.get("limit_gb")) else {
        return Err("body must be {'limit_gb': <float>}");
    };
    let limit_gb = python_float(raw).ok_or("limit_gb must be numeric")?;
    if !limit_gb.is_finite() {
        return Err("limit_gb must be finite");
    }
    if limit_gb < 0.0 {
        return Err("limit_gb must be non-negative");
    }
    Ok(limit_gb)
}

fn verr(kind: &str, loc: &[Value], msg: &str, input: &Value) -> Value {
    let mut full = vec![json!("body")];
    full.extend_from_slice(loc);
    json!({ "type": kind, "loc": full, "msg": msg, "input": input })
}

/// `json.loads` of bytes reads a UTF-8 byte order mark as the encoding's and
/// drops it.
fn without_bom(body: &[u8]) -> &[u8] {
    body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body)
}

/// A FastAPI model body: `Ok(None)` when absent (empty or `null`), 422 when not
/// JSON, 400 when not UTF-8 (FastAPI's answer to an error other than a JSON one).
fn model_body(body: &[u8]) -> Result<Option<Value>, Rejection> {
    if body.is_empty() {
        return Ok(None);
    }
    let body = without_bom(body);
    let Ok(text) = std::str::from_utf8(body) else {
        return Err(Rejection::detail(
            StatusCode::BAD_REQUEST,
            "There was an error parsing the body",
        ));
    };
    match python_json(body) {
        Ok(Value::Null) => Ok(None),
        Ok(v) => Ok(Some(v)),
        Err(e) => {
            // Python's position: characters before the error, all of them
            // when the text ended early.
            let byte = if e.is_eof() {
                body.len()
            } else {
                byte_offset(body, e.line(), e.column())
            };
            let pos = text.get(..byte).map_or(byte, |t| t.chars().count());
            Err(Rejection::validation(vec![json!({
                "type": "json_invalid",
                "loc": ["body", pos],
                "msg": "JSON decode error",
                "input": {},
                "ctx": { "error": e.to_string() },
            })]))
        }
    }
}

fn byte_offset(body: &[u8], line: usize, column: usize) -> usize {
    let mut offset = 0;
    for (i, l) in body.split(|b| *b == b'\n').enumerate() {
        if i + 1 == line {
            return (offset + column.saturating_sub(1)).min(body.len());
        }
        offset += l.len() + 1;
    }
    body.len()
}

fn model_object<'a>(
    v: &'a Value,
    class: &str,
    errors: &mut Vec<Value>,
) -> Option<&'a Map<String, Value>> {
    let obj = v.as_object();
    if obj.is_none() {
        errors.push(json!({
            "type": "dataclass_type",
            "loc": ["body"],
            "msg": format!("Input should be a dictionary or an instance of {class}"),
            "input": v,
            "ctx": { "class_name": class },
        }));
    }
    obj
}

/// pydantic's lax `bool`.
fn lax_bool(v: &Value, loc: &[Value], errors: &mut Vec<Value>) -> Option<bool> {
    let parsing = "Input should be a valid boolean, unable to interpret input";
    match v {
        Value::Bool(b) => return Some(*b),
        Value::Number(n) => match n.as_f64() {
            Some(0.0) => return Some(false),
            Some(1.0) => return Some(true),
            _ => errors.push(verr("bool_parsing", loc, parsing, v)),
        },
        Value::String(s) => match s.to_ascii_lowercase().as_str() {
            "0" | "off" | "f" | "false" | "n" | "no" => return Some(false),
            "1" | "on" | "t" | "true" | "y" | "yes" => return Some(true),
            _ => errors.push(verr("bool_parsing", loc, parsing, v)),
        },
        _ => errors.push(verr("bool_type", loc, "Input should be a valid boolean", v)),
    }
    None
}

/// An integer that pydantic's lax `int` accepts but that may not fit an i64.
enum LaxInt {
    Fits(i64),
    /// Valid for pydantic, outside i64; keeps the JSON text for messages.
    Huge {
        negative: bool,
        text: String,
    },
}

fn lax_int(v: &Value, loc: &[Value], errors: &mut Vec<Value>) -> Option<LaxInt> {
    let fractional = "Input should be a valid integer, got a number with a fractional part";
    let from_f64 = |x: f64, errors: &mut Vec<Value>| -> Option<LaxInt> {
        if !x.is_finite() {
            errors.push(verr(
                "finite_number",
                loc,
                "Input should be a finite number",
                v,
            ));
            None
        } else if x.fract() != 0.0 {
            errors.push(verr("int_from_float", loc, fractional, v));
            None
        } else if (i64::MIN as f64..-(i64::MIN as f64)).contains(&x) {
            Some(LaxInt::Fits(x as i64))
        } else {
            Some(LaxInt::Huge {
                negative: x < 0.0,
                text: format!("{x:.0}"),
            })
        }
    };
    match v {
        Value::Bool(b) => Some(LaxInt::Fits(i64::from(*b))),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                Some(LaxInt::Fits(i))
            } else if let Some(u) = n.as_u64() {
                Some(LaxInt::Huge {
                    negative: false,
                    text: u.to_string(),
                })
            } else {
                from_f64(n.as_f64().unwrap_or(f64::NAN), errors)
            }
        }
        Value::String(s) => {
            let t = s.trim();
            let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
            if !digits.is_empty() && digits.bytes().all(|c| c.is_ascii_digit()) {
                match t.parse::<i64>() {
                    Ok(i) => Some(LaxInt::Fits(i)),
                    Err(_) => Some(LaxInt::Huge {
                        negative: t.starts_with('-'),
                        text: t.to_string(),
                    }),
                }
            } else {
                errors.push(verr(
                    "int_parsing",
                    loc,
                    "Input should be a valid integer, unable to parse string as an integer",
                    v,
                ));
                None
            }
        }
        _ => {
            errors.push(verr("int_type", loc, "Input should be a valid integer", v));
            None
        }
    }
}

/// `POST /cache/clear`'s optional `ClearRequest {tier = "l1", force = false}`.
pub fn parse_clear(body: &[u8]) -> Result<bool, Rejection> {
    let Some(v) = model_body(body)? else {
        return Ok(false);
    };
    let mut errors = Vec::new();
    let Some(obj) = model_object(&v, "ClearRequest", &mut errors) else {
        return Err(Rejection::validation(errors));
    };
    let mut tier = "l1".to_string();
    if let Some(t) = obj.get("tier") {
        match t.as_str() {
            Some(s @ ("l1" | "l2" | "all")) => tier = s.to_string(),
            _ => errors.push(json!({
                "type": "enum",
                "loc": ["body", "tier"],
                "msg": "Input should be 'l1', 'l2' or 'all'",
                "input": t,
                "ctx": { "expected": "'l1', 'l2' or 'all'" },
            })),
        }
    }
    let force = match obj.get("force") {
        Some(f) => lax_bool(f, &[json!("force")], &mut errors).unwrap_or(false),
        None => false,
    };
    if !errors.is_empty() {
        return Err(Rejection::validation(errors));
    }
    if tier != "l1" {
        let msg = format!("tier '{tier}' not supported; only 'l1'");
        return Err(Rejection::detail(StatusCode::BAD_REQUEST, &msg));
    }
    Ok(force)
}

/// `POST /cache/checksums`' required `ChecksumRequest {block_ids = [], chunk_size = 0,
/// instance_id = 0, layerwise = false}`.
///
/// 0.5.6 looks the instance up (404) before checking `block_ids` and `chunk_size`
/// (400); here those two are checked first, because the control request cannot carry
/// a non-positive chunk size.
pub fn parse_checksums(body: &[u8]) -> Result<Checksums, Rejection> {
    let Some(v) = model_body(body)? else {
        return Err(Rejection::validation(vec![json!({
            "type": "missing", "loc": ["body"], "msg": "Field required", "input": null,
        })]));
    };
    let mut errors = Vec::new();
    let Some(obj) = model_object(&v, "ChecksumRequest", &mut errors) else {
        return Err(Rejection::validation(errors));
    };

    let mut block_ids: Vec<LaxInt> = Vec::new();
    if let Some(b) = obj.get("block_ids") {
        match b.as_array() {
            Some(items) => {
                for (i, item) in items.iter().enumerate() {
                    if let Some(x) = lax_int(item, &[json!("block_ids"), json!(i)], &mut errors) {
                        block_ids.push(x);
                    }
                }
            }
            None => errors.push(verr(
                "list_type",
                &[json!("block_ids")],
                "Input should be a valid list",
                b,
            )),
        }
    }
    let mut int_field = |name: &str| {
        obj.get(name)
            .map(|x| lax_int(x, &[json!(name)], &mut errors))
    };
    let chunk_size = int_field("chunk_size");
    let instance_id = int_field("instance_id");
    let layerwise = match obj.get("layerwise") {
        Some(l) => lax_bool(l, &[json!("layerwise")], &mut errors).unwrap_or(false),
        None => false,
    };
    if !errors.is_empty() {
        return Err(Rejection::validation(errors));
    }

    // With no errors reported, `None` means the field was absent (its default applies).
    let instance_id = match instance_id.flatten() {
        None => 0,
        Some(LaxInt::Fits(i)) => i,
        // No registration can have an id outside i64.
        Some(LaxInt::Huge { text, .. }) => {
            return Err(Rejection::detail(
                StatusCode::NOT_FOUND,
                &format!("instance_id {text} not registered"),
            ));
        }
    };
    let chunk_size_blocks = match chunk_size.flatten() {
        Some(LaxInt::Fits(i)) if i > 0 => usize::try_from(i).unwrap_or(usize::MAX),
        Some(LaxInt::Huge {
            negative: false, ..
        }) => usize::MAX,
        _ => 0,
    };
    let mut ids = Vec::with_capacity(block_ids.len());
    for b in block_ids {
        match b {
            LaxInt::Fits(i) => ids.push(i),
            LaxInt::Huge { text, .. } => {
                return Err(Rejection::detail(
                    StatusCode::BAD_REQUEST,
                    &format!("block id {text} is out of range"),
                ));
            }
        }
    }
    Ok(Checksums {
        instance_id,
        block_ids: ids,
        chunk_size_blocks,
        layerwise,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_floats() {
        assert_eq!(python_float_str("1e3"), Some(1000.0));
        assert_eq!(python_float_str("_1"), None);
        assert_eq!(python_float_str("1_"), None);
        assert!(python_float_str("-Infinity").unwrap().is_infinite());
        assert_eq!(python_float_str(""), None);
        assert_eq!(
            quote_nonfinite_literals(r#"{"a":"NaN x","b":-Infinity}"#).as_deref(),
            Some(r#"{"a":"NaN x","b":"-Infinity"}"#)
        );
        assert_eq!(quote_nonfinite_literals(r#"{"a":"\"NaN"}"#), None);
    }

    #[test]
    fn quota_limits() {
        assert_eq!(parse_limit_gb(br#"{"limit_gb": "1_0"}"#), Ok(10.0));
        assert_eq!(
            parse_limit_gb(br#"{"limit_gb": NaN}"#),
            Err("limit_gb must be finite")
        );
        assert_eq!(
            parse_limit_gb(b"[1]"),
            Err("body must be {'limit_gb': <float>}")
        );
        assert_eq!(
            parse_limit_gb(br#"{"limit_gb": -1}"#),
            Err("limit_gb must be non-negative")
        );
    }

    #[test]
    fn json_bodies_read_as_python_reads_bytes() {
        // A byte order mark is dropped.
        assert_eq!(parse_limit_gb(b"\xEF\xBB\xBF{\"limit_gb\": 1}"), Ok(1.0));
        assert_eq!(model_body(b"\xEF\xBB\xBF{}").unwrap(), Some(json!({})));
        // Bytes that are not UTF-8: 400 from a model body, as FastAPI answers.
        assert_eq!(
            model_body(b"{\"tier\":\"\xff\"}").unwrap_err(),
            Rejection::detail(
                StatusCode::BAD_REQUEST,
                "There was an error parsing the body"
            )
        );
        assert_eq!(parse_limit_gb(b"\xff"), Err("invalid JSON body"));
        // The error's position counts characters, and all of them at the end.
        let loc = |body: &[u8]| model_body(body).unwrap_err().body["detail"][0]["loc"].clone();
        assert_eq!(loc(b"{\"tier\":"), json!(["body", 8]));
        assert_eq!(loc("{\"t\u{e9}\": x}".as_bytes()), json!(["body", 7]));
    }

    #[test]
    fn checksum_bodies() {
        let ok = parse_checksums(br#"{"block_ids": [1, "2", true], "chunk_size": "16"}"#);
        assert_eq!(
            ok,
            Ok(Checksums {
                instance_id: 0,
                block_ids: vec![1, 2, 1],
                chunk_size_blocks: 16,
                layerwise: false
            })
        );
        let err = parse_checksums(br#"{"block_ids": [1.5], "layerwise": "maybe"}"#).unwrap_err();
        assert_eq!(err.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(
            err.body["detail"].as_array().map(Vec::len),
            Some(2),
            "{}",
            err.body
        );
        // What 0.5.6 refuses only after finding the instance passes here.
        for (body, ids, chunk) in [
            (&br#"{}"#[..], vec![], 0),
            (br#"{"block_ids": [1]}"#, vec![1], 0),
            (br#"{"block_ids": [], "chunk_size": -3}"#, vec![], 0),
        ] {
            let c = parse_checksums(body).unwrap();
            assert_eq!((c.block_ids, c.chunk_size_blocks), (ids, chunk));
        }
        assert_eq!(
            parse_checksums(b"").unwrap_err().status,
            StatusCode::UNPROCESSABLE_ENTITY
        );
    }

    #[test]
    fn clear_bodies() {
        assert_eq!(parse_clear(b""), Ok(false));
        assert_eq!(parse_clear(br#"{"force": "yes"}"#), Ok(true));
        assert_eq!(
            parse_clear(b"{").unwrap_err().body["detail"][0]["type"],
            "json_invalid"
        );
        assert_eq!(
            parse_clear(br#"{"tier": "l2"}"#).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}
