//! `kvshard server --config FILE`: lmcache's (non-MP) YAML configuration of an
//! S3 backend (`remote_url: "s3://..."` plus `extra_config`), mapped onto
//! kvshard's flags and one `s3` L2 adapter.
//!
//! The mapping:
//!
//! | YAML | kvshard |
//! | --- | --- |
//! | `chunk_size` | `--chunk-size` |
//! | `max_local_cpu_size` (GB, default 5) | `--l1-size-gb` |
//! | `local_cpu: False` | `--l2-store-policy skip_l1` (L1 only stages) |
//! | `remote_url: s3://...` | the adapter's `s3_endpoint` |
//! | `blocking_timeout_secs` (default 10) | the adapter's `s3_request_timeout_secs` |
//! | `extra_config.s3_num_io_threads` / `s3_max_io_concurrency` | `s3_num_io_threads` |
//! | `extra_config.s3_max_inflight_reqs` | `s3_max_inflight_requests` |
//! | `extra_config.s3_file_prefix` | `s3_key_prefix` |
//! | `extra_config.s3_region`, `s3_prefer_http2`, `s3_enable_s3express`, `disable_tls`, `aws_access_key_id`, `aws_secret_access_key` | the same adapter fields |
//!
//! The eviction policy is LRU unless a flag says otherwise. Flags given on the
//! command line after `--config` win over the file. A setting that cannot hold
//! is refused with the reason: `save_unfull_chunk: True` (S3 objects are whole
//! chunks), `save_chunk_meta: True`, a `remote_serde` other than `naive`, a
//! `remote_url` that is not `s3://`, any key this mapping does not know, and
//! unfilled `{PLACEHOLDER}`s from the documentation's examples.
//!
//! The file is read by a small parser for the YAML these configurations use:
//! block mappings (nested by indentation), comments, and plain, single- or
//! double-quoted scalars with YAML 1.1 booleans (`True`, `yes`, `off`...) as
//! PyYAML reads them. Anything else (sequences, flow collections, anchors,
//! block scalars, several documents) is refused with its line number.

use serde_json::{json, Map, Value};

/// A YAML scalar as PyYAML's `safe_load` types it.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Scalar(Scalar),
    Map(Vec<Entry>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub key: String,
    pub value: Node,
    /// 1-based line of the key, for messages.
    pub line: usize,
}

struct Line<'a> {
    number: usize,
    indent: usize,
    text: &'a str,
}

/// Parses `text` into its top-level mapping.
pub fn parse_yaml(text: &str) -> Result<Vec<Entry>, String> {
    let mut lines = Vec::new();
    let mut started = false;
    for (i, raw) in text.lines().enumerate() {
        let number = i + 1;
        let body = strip_comment(raw);
        if body.trim().is_empty() {
            continue;
        }
        let indent = body.len() - body.trim_start_matches(' ').len();
        if body[indent..].starts_with('\t') {
            return Err(format!(
                "line {number}: tabs are not allowed for indentation"
            ));
        }
        let t = body.trim_end();
        if indent == 0 && (t == "---" || t == "...") {
            if started && t == "---" {
                return Err(format!(
                    "line {number}: several YAML documents in one file are not supported"
                ));
            }
            continue;
        }
        started = true;
        lines.push(Line {
            number,
            indent,
            text: &t[indent..],
        });
    }
    if lines.is_empty() {
        return Err("the file holds no settings".into());
    }
    let mut pos = 0;
    let map = parse_block(&lines, &mut pos, lines[0].indent)?;
    if let Some(l) = lines.get(pos) {
        return Err(format!("line {}: unexpected indentation", l.number));
    }
    Ok(map)
}

/// Removes a `#` comment (one that starts the line or follows whitespace,
/// outside quotes).
fn strip_comment(line: &str) -> &str {
    let (mut single, mut double) = (false, false);
    let mut prev_space = true;
    for (i, c) in line.char_indices() {
        match c {
            '\'' if !double => single = !single,
            '"' if !single => double = !double,
            '#' if !single && !double && prev_space => return &line[..i],
            _ => {}
        }
        prev_space = c == ' ' || c == '\t';
    }
    line
}

fn parse_block(lines: &[Line], pos: &mut usize, indent: usize) -> Result<Vec<Entry>, String> {
    let mut out: Vec<Entry> = Vec::new();
    while let Some(l) = lines.get(*pos) {
        if l.indent < indent {
            break;
        }
        if l.indent > indent {
            return Err(format!("line {}: unexpected indentation", l.number));
        }
        if l.text.starts_with("- ") || l.text == "-" {
            return Err(format!(
                "line {}: YAML sequences are not supported here",
                l.number
            ));
        }
        let Some((key, rest)) = split_key(l.text) else {
            return Err(format!(
                "line {}: expected 'key: value', got {:?}",
                l.number, l.text
            ));
        };
        if out.iter().any(|e| e.key == key) {
            return Err(format!("line {}: key '{key}' appears twice", l.number));
        }
        *pos += 1;
        let value = if rest.is_empty() {
            match lines.get(*pos) {
                Some(next) if next.indent > indent => {
                    Node::Map(parse_block(lines, pos, next.indent)?)
                }
                _ => Node::Scalar(Scalar::Null),
            }
        } else {
            Node::Scalar(parse_scalar(rest, l.number)?)
        };
        out.push(Entry {
            key: key.to_string(),
            value,
            line: l.number,
        });
    }
    Ok(out)
}

/// `key: rest` with a plain key of letters, digits, `_`, `-` and `.`.
fn split_key(text: &str) -> Option<(&str, &str)> {
    let colon = text.find(':')?;
    let key = &text[..colon];
    let rest = &text[colon + 1..];
    if key.is_empty()
        || !key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        || !(rest.is_empty() || rest.starts_with(' '))
    {
        return None;
    }
    Some((key, rest.trim()))
}

fn parse_scalar(s: &str, line: usize) -> Result<Scalar, String> {
    if let Some(inner) = s.strip_prefix('"') {
        return double_quoted(inner, line).map(Scalar::Str);
    }
    if let Some(inner) = s.strip_prefix('\'') {
        let Some(body) = inner.strip_suffix('\'') else {
            return Err(format!("line {line}: unterminated single-quoted string"));
        };
        if body.replace("''", "").contains('\'') {
            return Err(format!(
                "line {line}: stray quote in a single-quoted string"
            ));
        }
        return Ok(Scalar::Str(body.replace("''", "'")));
    }
    if let Some(c) = s.chars().next() {
        if "[{&*!|>%@`".contains(c) {
            return Err(format!(
                "line {line}: {s:?}: flow collections, anchors, tags and block scalars are not supported"
            ));
        }
    }
    Ok(match s {
        "~" | "null" | "Null" | "NULL" => Scalar::Null,
        "true" | "True" | "TRUE" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => Scalar::Bool(true),
        "false" | "False" | "FALSE" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => {
            Scalar::Bool(false)
        }
        _ => {
            let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
            if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                s.parse::<i64>()
                    .map(Scalar::Int)
                    .map_err(|_| format!("line {line}: integer {s} is out of range"))?
            } else if digits
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_digit() || b == b'.')
                && digits
                    .bytes()
                    .all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-'))
                && digits.bytes().any(|b| b.is_ascii_digit())
            {
                match s.parse::<f64>() {
                    Ok(x) => Scalar::Float(x),
                    Err(_) => Scalar::Str(s.to_string()),
                }
            } else {
                Scalar::Str(s.to_string())
            }
        }
    })
}

fn double_quoted(inner: &str, line: usize) -> Result<String, String> {
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                return if chars.as_str().is_empty() {
                    Ok(out)
                } else {
                    Err(format!("line {line}: text after a closing quote"))
                }
            }
            '\\' => match chars.next() {
                Some('"') => out.push('"'),
                Some('\\') => out.push('\\'),
                Some('/') => out.push('/'),
                Some('n') => out.push('\n'),
                Some('t') => out.push('\t'),
                Some(e) => return Err(format!("line {line}: unsupported escape \\{e}")),
                None => break,
            },
            c => out.push(c),
        }
    }
    Err(format!("line {line}: unterminated double-quoted string"))
}

/// What a config file turns into: flags to put in front of the command line,
/// and notes to log.
#[derive(Debug)]
pub struct Expanded {
    pub flags: Vec<String>,
    pub notes: Vec<String>,
}

fn describe(n: &Node) -> &'static str {
    match n {
        Node::Map(_) => "a mapping",
        Node::Scalar(Scalar::Null) => "null",
        Node::Scalar(Scalar::Bool(_)) => "a boolean",
        Node::Scalar(Scalar::Int(_)) => "an integer",
        Node::Scalar(Scalar::Float(_)) => "a number",
        Node::Scalar(Scalar::Str(_)) => "a string",
    }
}

struct Field<'a> {
    name: String,
    node: &'a Node,
}

impl Field<'_> {
    fn err(&self, want: &str) -> String {
        format!(
            "'{}' must be {want}, got {}",
            self.name,
            describe(self.node)
        )
    }

    fn boolean(&self) -> Result<bool, String> {
        match self.node {
            Node::Scalar(Scalar::Bool(b)) => Ok(*b),
            _ => Err(self.err("True or False")),
        }
    }

    fn positive_int(&self) -> Result<i64, String> {
        match self.node {
            Node::Scalar(Scalar::Int(n)) if *n > 0 => Ok(*n),
            _ => Err(self.err("a positive integer")),
        }
    }

    fn positive_number(&self) -> Result<f64, String> {
        match self.node {
            Node::Scalar(Scalar::Int(n)) if *n > 0 => Ok(*n as f64),
            Node::Scalar(Scalar::Float(x)) if *x > 0.0 && x.is_finite() => Ok(*x),
            _ => Err(self.err("a positive number")),
        }
    }

    fn string(&self) -> Result<String, String> {
        let s = match self.node {
            Node::Scalar(Scalar::Str(s)) if !s.is_empty() => s.clone(),
            _ => return Err(self.err("a non-empty string")),
        };
        if let Some(open) = s.find('{') {
            if let Some(len) = s[open..].find('}') {
                return Err(format!(
                    "'{}' still holds the placeholder {}: put your value in its place",
                    self.name,
                    &s[open..open + len + 1]
                ));
            }
        }
        Ok(s)
    }
}

/// Maps a parsed lmcache YAML configuration onto kvshard flags.
pub fn expand(entries: &[Entry]) -> Result<Expanded, String> {
    let mut notes = Vec::new();
    let mut flags: Vec<String> = vec!["--eviction-policy".into(), "LRU".into()];
    let mut adapter = Map::new();
    adapter.insert("type".into(), json!("s3"));
    let mut l1_gb = 5.0;
    let mut remote = None;
    let mut timeout_secs = 10.0;
    let mut io_threads = None;
    for e in entries {
        let f = Field {
            name: e.key.clone(),
            node: &e.value,
        };
        let at = |m: String| format!("line {}: {m}", e.line);
        match e.key.as_str() {
            "chunk_size" => {
                let n = f.positive_int().map_err(at)?;
                flags.extend(["--chunk-size".into(), n.to_string()]);
            }
            "local_cpu" => {
                if !f.boolean().map_err(at)? {
                    flags.extend(["--l2-store-policy".into(), "skip_l1".into()]);
                    notes.push(
                        "--config: local_cpu False: L1 only stages chunks on their way to and \
                         from S3 (--l2-store-policy skip_l1)"
                            .into(),
                    );
                }
            }
            "max_local_cpu_size" => l1_gb = f.positive_number().map_err(at)?,
            "save_unfull_chunk" => {
                if f.boolean().map_err(at)? {
                    return Err(at(
                        "'save_unfull_chunk: True' cannot hold: S3 objects are whole chunks (lmcache's \
                         S3 backend rejects partial chunks too); set it to False"
                            .into(),
                    ));
                }
            }
            "remote_url" => {
                let url = f.string().map_err(at)?;
                if !url.starts_with("s3://") {
                    return Err(at(format!(
                        "'remote_url' {url:?}: only s3:// URLs are supported by kvshard's --config"
                    )));
                }
                remote = Some(url);
            }
            "remote_serde" => {
                let serde = f.string().map_err(at)?;
                if serde != "naive" {
                    return Err(at(format!(
                        "'remote_serde: {serde}' cannot hold: objects are stored as raw KV bytes \
                         ('naive'), the form lmcache's S3 adapter reads"
                    )));
                }
            }
            "blocking_timeout_secs" => timeout_secs = f.positive_number().map_err(at)?,
            "enable_async_loading" => {
                f.boolean().map_err(at)?;
                notes.push(
                    "--config: enable_async_loading has no effect: kvshard always prefetches \
                     from L2 in the background"
                        .into(),
                );
            }
            "extra_config" => {
                let Node::Map(extra) = &e.value else {
                    return Err(at(f.err("a mapping")));
                };
                for x in extra {
                    let g = Field {
                        name: format!("extra_config.{}", x.key),
                        node: &x.value,
                    };
                    let at = |m: String| format!("line {}: {m}", x.line);
                    match x.key.as_str() {
                        "s3_region" => {
                            adapter.insert("s3_region".into(), json!(g.string().map_err(at)?));
                        }
                        "s3_num_io_threads" | "s3_max_io_concurrency" => {
                            let n = g.positive_int().map_err(at)?;
                            io_threads = Some(io_threads.map_or(n, |m: i64| m.min(n)));
                        }
                        "s3_max_inflight_reqs" => {
                            let n = g.positive_int().map_err(at)?;
                            adapter.insert("s3_max_inflight_requests".into(), json!(n));
                        }
                        "s3_prefer_http2" | "s3_enable_s3express" | "disable_tls" => {
                            adapter.insert(x.key.clone(), json!(g.boolean().map_err(at)?));
                        }
                        "aws_access_key_id" | "aws_secret_access_key" => {
                            adapter.insert(x.key.clone(), json!(g.string().map_err(at)?));
                        }
                        "s3_file_prefix" => {
                            adapter.insert("s3_key_prefix".into(), json!(g.string().map_err(at)?));
                        }
                        "save_chunk_meta" => {
                            if g.boolean().map_err(at)? {
                                return Err(at(
                                    "'extra_config.save_chunk_meta: True' cannot hold: S3 objects \
                                     carry the KV bytes only; set it to False"
                                        .into(),
                                ));
                            }
                        }
                        other => {
                            return Err(at(format!(
                                "'extra_config.{other}' is not supported by kvshard's --config"
                            )))
                        }
                    }
                }
            }
            other => {
                return Err(at(format!(
                    "'{other}' is not supported by kvshard's --config (it maps lmcache's S3 \
                     backend settings only)"
                )))
            }
        }
    }
    let Some(remote) = remote else {
        return Err("'remote_url' is missing: the configuration must name an s3:// bucket".into());
    };
    if !adapter.contains_key("s3_region") {
        return Err("'extra_config.s3_region' is missing: the S3 region is required".into());
    }
    adapter.insert("s3_endpoint".into(), json!(remote));
    adapter.insert("s3_request_timeout_secs".into(), json!(timeout_secs));
    if let Some(n) = io_threads {
        adapter.insert("s3_num_io_threads".into(), json!(n));
    }
    flags.extend(["--l1-size-gb".into(), l1_gb.to_string()]);
    flags.extend(["--l2-adapter".into(), Value::Object(adapter).to_string()]);
    Ok(Expanded { flags, notes })
}

/// Reads and maps `path`.
pub fn load(path: &str) -> Result<Expanded, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("--config {path}: {e}"))?;
    let entries = parse_yaml(&text).map_err(|e| format!("--config {path}: {e}"))?;
    expand(&entries).map_err(|e| format!("--config {path}: {e}"))
}

/// Rewrites `kvshard server ... --config FILE ...`: the file's flags go right
/// after `server`, so that flags on the command line override them.
pub fn expand_args(mut args: Vec<String>) -> Result<(Vec<String>, Vec<String>), String> {
    if args.get(1).map(String::as_str) != Some("server") {
        return Ok((args, Vec::new()));
    }
    let mut path = None;
    let mut i = 2;
    while i < args.len() {
        if args[i] == "--config" {
            path = Some(
                args.get(i + 1)
                    .cloned()
                    .ok_or("--config needs a file name")?,
            );
            i += 2;
        } else if let Some(p) = args[i].strip_prefix("--config=") {
            path = Some(p.to_string());
            i += 1;
        } else {
            i += 1;
        }
    }
    let Some(path) = path else {
        return Ok((args, Vec::new()));
    };
    let e = load(&path)?;
    args.splice(2..2, e.flags);
    Ok((args, e.notes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter_of(e: &Expanded) -> Value {
        let i = e.flags.iter().position(|f| f == "--l2-adapter").unwrap();
        serde_json::from_str(&e.flags[i + 1]).unwrap()
    }

    fn flag<'a>(e: &'a Expanded, name: &str) -> Option<&'a str> {
        let i = e.flags.iter().position(|f| f == name)?;
        Some(e.flags[i + 1].as_str())
    }

    #[test]
    fn scalars_as_pyyaml_types_them() {
        let m = parse_yaml(
            "a: True\nb: off\nc: 10\nd: -3\ne: 2.5\nf: \"s3://x\"  # comment\ng: 'it''s'\nh:\ni: ~\nj: plain text # c\nk: \"a#b\"\n",
        )
        .unwrap();
        let v: Vec<&Node> = m.iter().map(|e| &e.value).collect();
        assert_eq!(v[0], &Node::Scalar(Scalar::Bool(true)));
        assert_eq!(v[1], &Node::Scalar(Scalar::Bool(false)));
        assert_eq!(v[2], &Node::Scalar(Scalar::Int(10)));
        assert_eq!(v[3], &Node::Scalar(Scalar::Int(-3)));
        assert_eq!(v[4], &Node::Scalar(Scalar::Float(2.5)));
        assert_eq!(v[5], &Node::Scalar(Scalar::Str("s3://x".into())));
        assert_eq!(v[6], &Node::Scalar(Scalar::Str("it's".into())));
        assert_eq!(v[7], &Node::Scalar(Scalar::Null));
        assert_eq!(v[8], &Node::Scalar(Scalar::Null));
        assert_eq!(v[9], &Node::Scalar(Scalar::Str("plain text".into())));
        assert_eq!(v[10], &Node::Scalar(Scalar::Str("a#b".into())));
    }

    #[test]
    fn nested_mappings_and_errors_with_lines() {
        let m = parse_yaml("---\nx: 1\nextra_config:\n  a: 1\n  b: \"q\"\ny: 2\n").unwrap();
        assert_eq!(m.len(), 3);
        let Node::Map(inner) = &m[1].value else {
            panic!()
        };
        assert_eq!(inner.len(), 2);
        for (text, want) in [
            ("a: 1\n  b: 2\n", "line 2: unexpected indentation"),
            ("a:\n  - 1\n", "line 2: YAML sequences"),
            ("a: [1, 2]\n", "line 1"),
            ("a: &x 1\n", "anchors"),
            ("a: 1\na: 2\n", "line 2: key 'a' appears twice"),
            ("a: \"open\n", "unterminated"),
            ("just text\n", "expected 'key: value'"),
            ("a: 1\n---\nb: 2\n", "several YAML documents"),
            ("\ta: 1\n", "tabs"),
            ("", "no settings"),
        ] {
            let e = parse_yaml(text).unwrap_err();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn refusals_give_the_reason() {
        let base =
            "remote_url: \"s3://bkt.localhost:9000\"\nextra_config:\n  s3_region: \"us-east-1\"\n";
        let err = |extra: &str| {
            let text = format!("{base}{extra}");
            expand(&parse_yaml(&text).unwrap()).unwrap_err()
        };
        assert!(err("save_unfull_chunk: True\n").contains("whole chunks"));
        assert!(err("remote_serde: \"cachegen\"\n").contains("'remote_serde: cachegen'"));
        assert!(err("local_disk: \"file:///x\"\n").contains("'local_disk' is not supported"));
        assert!(err("chunk_size: 0\n").contains("'chunk_size' must be a positive integer"));
        assert!(err("local_cpu: 1\n").contains("'local_cpu' must be True or False"));
        assert!(err("extra_config2: 1\n").contains("not supported"));
        let e = expand(&parse_yaml("remote_url: \"lm://host:1\"\n").unwrap()).unwrap_err();
        assert!(e.contains("only s3://"), "{e}");
        let e = expand(&parse_yaml("chunk_size: 256\n").unwrap()).unwrap_err();
        assert!(e.contains("'remote_url' is missing"), "{e}");
        let e = expand(&parse_yaml("remote_url: \"s3://b.localhost\"\n").unwrap()).unwrap_err();
        assert!(e.contains("s3_region"), "{e}");
        let text = "remote_url: \"s3://b.localhost\"\nextra_config:\n  s3_region: r\n  save_chunk_meta: True\n";
        assert!(expand(&parse_yaml(text).unwrap())
            .unwrap_err()
            .contains("save_chunk_meta"));
        let text = "remote_url: \"s3://{BUCKET_NAME}.s3express-{AZ_ID}.{REGION}.amazonaws.com\"\n";
        let e = expand(&parse_yaml(text).unwrap()).unwrap_err();
        assert!(e.contains("placeholder {BUCKET_NAME}"), "{e}");
    }

    #[test]
    fn flags_map_onto_the_s3_adapter() {
        let text = "chunk_size: 256\nlocal_cpu: False\nmax_local_cpu_size: 50\nremote_url: \"s3://bkt.localhost:9000\"\n\
                    blocking_timeout_secs: 100\nextra_config:\n  s3_region: \"us-east-1\"\n  s3_max_io_concurrency: 320\n\
                    \x20 s3_max_inflight_reqs: 64\n  s3_file_prefix: \"test-2\"\n";
        let e = expand(&parse_yaml(text).unwrap()).unwrap();
        assert_eq!(flag(&e, "--chunk-size"), Some("256"));
        assert_eq!(flag(&e, "--l1-size-gb"), Some("50"));
        assert_eq!(flag(&e, "--l2-store-policy"), Some("skip_l1"));
        assert_eq!(flag(&e, "--eviction-policy"), Some("LRU"));
        let a = adapter_of(&e);
        assert_eq!(a["type"], "s3");
        assert_eq!(a["s3_endpoint"], "s3://bkt.localhost:9000");
        assert_eq!(a["s3_num_io_threads"], 320);
        assert_eq!(a["s3_max_inflight_requests"], 64);
        assert_eq!(a["s3_key_prefix"], "test-2");
        assert_eq!(a["s3_request_timeout_secs"], 100.0);
        // The adapter JSON is one the --l2-adapter parser accepts.
        kvshard_engine::l2::config::parse_adapter_spec(1, &a.to_string()).unwrap();
    }

    #[test]
    fn config_flags_go_first_so_the_command_line_wins() {
        let dir = std::env::temp_dir().join(format!("kvshard-yaml-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.yaml");
        std::fs::write(
            &path,
            "chunk_size: 256\nremote_url: \"s3://bkt.localhost:9000\"\nextra_config:\n  s3_region: r\n",
        )
        .unwrap();
        let p = path.to_str().unwrap().to_string();
        let args: Vec<String> = ["kvshard", "server", "--config", &p, "--chunk-size", "512"]
            .map(String::from)
            .to_vec();
        let (out, _) = expand_args(args).unwrap();
        assert_eq!(&out[..4], ["kvshard", "server", "--eviction-policy", "LRU"]);
        assert_eq!(out.last().unwrap(), "512");
        let first = out.iter().position(|a| a == "--chunk-size").unwrap();
        assert_eq!(out[first + 1], "256");
        let missing = expand_args(
            ["kvshard", "server", "--config=/nonexistent/x.yaml"]
                .map(String::from)
                .to_vec(),
        )
        .unwrap_err();
        assert!(missing.contains("/nonexistent/x.yaml"), "{missing}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// The six example configurations of lmcache's S3 backend documentation
    /// (two revisions of three examples), placeholders filled in.
    const DOC_EXAMPLES: &[&str] = &[
        "chunk_size: 256\nlocal_cpu: False\nsave_unfull_chunk: False\nremote_url: \"s3://your-bucket-name\"\n\
         remote_serde: \"naive\"\nblocking_timeout_secs: 10\nextra_config:\n  s3_region: \"us-east-1\"\n\
         \x20 s3_num_io_threads: 64\n  save_chunk_meta: False\n",
        "chunk_size: 256\nlocal_cpu: False\nsave_unfull_chunk: False\n\
         remote_url: \"s3://{BUCKET_NAME}.s3express-{AZ_ID}.{REGION}.amazonaws.com\"\nremote_serde: \"naive\"\n\
         blocking_timeout_secs: 10\nextra_config:\n  save_chunk_meta: False\n  s3_num_io_threads: 64\n\
         \x20 s3_prefer_http2: True\n  s3_region: \"{REGION}\"\n  s3_enable_s3express: True\n",
        "chunk_size: 256\nlocal_cpu: False\nmax_local_cpu_size: 50\nsave_unfull_chunk: False\n\
         enable_async_loading: True\nremote_url: \"s3://test-127.cwlota.com\"\nremote_serde: \"naive\"\n\
         blocking_timeout_secs: 10\nextra_config:\n  s3_num_io_threads: 320\n  s3_prefer_http2: False\n\
         \x20 s3_region: \"US-WEST-04A\"\n  s3_enable_s3express: False\n  save_chunk_meta: False\n\
         \x20 disable_tls: True\n  aws_access_key_id: \"your-access-key-id\"\n\
         \x20 aws_secret_access_key: \"your-secret-access-key\"\n",
        "chunk_size: 256\nlocal_cpu: False\nsave_unfull_chunk: False\nremote_url: \"s3://your-bucket-name\"\n\
         remote_serde: \"naive\"\nblocking_timeout_secs: 100\nextra_config:\n  s3_region: \"us-east-1\"\n\
         \x20 s3_max_io_concurrency: 64\n  s3_max_inflight_reqs: 64\n",
        "chunk_size: 256\nlocal_cpu: False\nsave_unfull_chunk: False\n\
         remote_url: \"s3://{BUCKET_NAME}.s3express-{AZ_ID}.{REGION}.amazonaws.com\"\nremote_serde: \"naive\"\n\
         blocking_timeout_secs: 100\nextra_config:\n  s3_max_io_concurrency: 64\n  s3_max_inflight_reqs: 64\n\
         \x20 s3_prefer_http2: True\n  s3_region: \"{REGION}\"\n  s3_enable_s3express: True\n\
         \x20 s3_file_prefix: \"{FILE_PREFIX}\"\n",
        "chunk_size: 256\nlocal_cpu: False\nmax_local_cpu_size: 50\nsave_unfull_chunk: False\n\
         enable_async_loading: True\nremote_url: \"s3://test-127.cwlota.com\"\nremote_serde: \"naive\"\n\
         blocking_timeout_secs: 100\nextra_config:\n  s3_max_io_concurrency: 320\n  s3_max_inflight_reqs: 320\n\
         \x20 s3_prefer_http2: False\n  s3_region: \"US-WEST-04A\"\n  s3_enable_s3express: False\n\
         \x20 save_chunk_meta: False\n  s3_file_prefix: \"test-2\"\n",
    ];

    #[test]
    fn every_documentation_example_maps_onto_a_valid_adapter() {
        for (i, raw) in DOC_EXAMPLES.iter().enumerate() {
            // As written, the placeholders are refused with their name.
            if raw.contains('{') {
                let e = expand(&parse_yaml(raw).unwrap()).unwrap_err();
                assert!(e.contains("placeholder {"), "example {i}: {e}");
            }
            let text = raw
                .replace("{BUCKET_NAME}", "kvcache--use1-az4--x-s3")
                .replace("{AZ_ID}", "use1-az4")
                .replace("{REGION}", "us-east-1")
                .replace("{FILE_PREFIX}", "lmcache");
            let e =
                expand(&parse_yaml(&text).unwrap()).unwrap_or_else(|e| panic!("example {i}: {e}"));
            assert_eq!(flag(&e, "--chunk-size"), Some("256"), "example {i}");
            assert_eq!(
                flag(&e, "--l2-store-policy"),
                Some("skip_l1"),
                "example {i}"
            );
            let a = adapter_of(&e);
            let spec = kvshard_engine::l2::config::parse_adapter_spec(1, &a.to_string())
                .unwrap_or_else(|e| panic!("example {i}: {e}"));
            assert_eq!(spec.type_name(), "s3");
            let want_timeout = if i < 3 { 10.0 } else { 100.0 };
            assert_eq!(a["s3_request_timeout_secs"], want_timeout, "example {i}");
            match i {
                1 | 4 => {
                    assert_eq!(a["s3_enable_s3express"], true);
                    assert!(a["s3_endpoint"]
                        .as_str()
                        .unwrap()
                        .starts_with("s3://kvcache--use1-az4--x-s3.s3express-use1-az4."));
                }
                2 => {
                    assert_eq!(flag(&e, "--l1-size-gb"), Some("50"));
                    assert_eq!(a["disable_tls"], true);
                    assert_eq!(a["s3_num_io_threads"], 320);
                    assert_eq!(spec.json["aws_secret_access_key"], "***");
                }
                5 => {
                    assert_eq!(a["s3_key_prefix"], "test-2");
                    assert_eq!(a["s3_max_inflight_requests"], 320);
                }
                _ => {}
            }
        }
    }
}
