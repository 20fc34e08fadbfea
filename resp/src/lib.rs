//! The RESP2 wire format Redis and Valkey speak (the protocol lmcache
//! 0.5.6's `resp` and `valkey` adapters use), without I/O:
//!
//! - commands are arrays of bulk strings ([`encode`]); a command whose last
//!   argument is a value body ([`encode_with_body`]) leaves that body out, so
//!   the caller sends it from where it lies (an L1 object) in a vectored
//!   write, then [`CRLF`];
//! - replies are parsed head first ([`parse_head`]): a bulk string's head
//!   says how many bytes follow, so the caller can read them straight into
//!   their destination and check the [`CRLF`] after them ([`check_bulk_end`]);
//!   small replies (status, integers, errors, a cluster's slot map) parse
//!   whole ([`parse_reply`]).
//!
//! Every length is bounded before anything is allocated for it, and a byte
//! stream that is not RESP is an error, never a panic: the connection that
//! carried it is then out of step and must be closed.

pub mod client;
pub mod cluster;
pub mod router;
use std::fmt;

/// What ends every line and every bulk body.
pub const CRLF: &[u8] = b"\r\n";

/// Longest status, error or integer line accepted (servers send short ones;
/// a longer one means the stream is not RESP).
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Largest bulk string accepted: Redis's own `proto-max-bulk-len` default.
pub const MAX_BULK_BYTES: usize = 512 << 20;

/// Most elements of one array: a cluster's slot map stays far below.
pub const MAX_ARRAY_LEN: usize = 1 << 20;

/// Deepest nesting of arrays a reply may have.
pub const MAX_DEPTH: usize = 8;

/// The start of one reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head<'a> {
    /// `+OK`: a status line (without its CRLF).
    Simple(&'a [u8]),
    /// `-ERR ...`: an error line (without its CRLF).
    Error(&'a [u8]),
    /// `:42`.
    Integer(i64),
    /// `$n`: `n` bytes follow, then CRLF.
    Bulk(usize),
    /// `$-1`, `*-1` (RESP2) or `_` (RESP3): no value, e.g. GET of a missing
    /// key.
    Nil,
    /// `*n`: `n` replies follow.
    Array(usize),
}

/// A whole reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Simple(Vec<u8>),
    Error(Vec<u8>),
    Integer(i64),
    Bulk(Vec<u8>),
    Nil,
    Array(Vec<Reply>),
}

/// Why bytes are not a RESP reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RespError {
    /// A reply starts with this byte, which starts no reply this client reads.
    UnknownType(u8),
    /// A line longer than [`MAX_LINE_BYTES`].
    LineTooLong,
    /// A line holds a CR or LF that is not its CRLF end.
    BadLineEnd,
    /// A length or integer that is not a decimal `i64`.
    BadInteger,
    /// A bulk string longer than [`MAX_BULK_BYTES`].
    BulkTooLarge(i64),
    /// An array longer than [`MAX_ARRAY_LEN`].
    ArrayTooLong(i64),
    /// A length below -1.
    NegativeLength(i64),
    /// Arrays nested deeper than [`MAX_DEPTH`].
    TooDeep,
    /// A bulk body not followed by CRLF.
    BadBulkEnd,
}

impl fmt::Display for RespError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RespError::UnknownType(b) => {
                write!(
                    f,
                    "RESP: a reply starts with byte {b:#04x}, which starts no RESP2 reply"
                )
            }
            RespError::LineTooLong => {
                write!(
                    f,
                    "RESP: a reply line is longer than {MAX_LINE_BYTES} bytes"
                )
            }
            RespError::BadLineEnd => f.write_str("RESP: a reply line holds a bare CR or LF"),
            RespError::BadInteger => f.write_str("RESP: a length or integer is not a decimal i64"),
            RespError::BulkTooLarge(n) => write!(
                f,
                "RESP: a bulk string of {n} bytes is larger than the {MAX_BULK_BYTES} accepted"
            ),
            RespError::ArrayTooLong(n) => write!(
                f,
                "RESP: an array of {n} elements is longer than the {MAX_ARRAY_LEN} accepted"
            ),
            RespError::NegativeLength(n) => write!(f, "RESP: length {n} (only -1 means nil)"),
            RespError::TooDeep => write!(f, "RESP: arrays nested deeper than {MAX_DEPTH}"),
            RespError::BadBulkEnd => f.write_str("RESP: a bulk string is not followed by CRLF"),
        }
    }
}

impl std::error::Error for RespError {}

/// The line at the start of `buf` (without its CRLF) and the bytes it takes
/// with it; `None` while its CRLF has not arrived.
fn line(buf: &[u8]) -> Result<Option<(&[u8], usize)>, RespError> {
    let window = &buf[..buf.len().min(MAX_LINE_BYTES + 2)];
    match window.iter().position(|&b| b == b'\r' || b == b'\n') {
        Some(i) if window[i] == b'\n' => Err(RespError::BadLineEnd),
        Some(i) => match window.get(i + 1) {
            Some(b'\n') => Ok(Some((&buf[..i], i + 2))),
            Some(_) => Err(RespError::BadLineEnd),
            None if buf.len() > i + 1 => Err(RespError::LineTooLong),
            None => Ok(None),
        },
        None if buf.len() > MAX_LINE_BYTES + 1 => Err(RespError::LineTooLong),
        None => Ok(None),
    }
}

/// A decimal `i64`: an optional `-`, then at least one digit.
fn integer(digits: &[u8]) -> Result<i64, RespError> {
    let (negative, digits) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, digits),
    };
    if digits.is_empty() {
        return Err(RespError::BadInteger);
    }
    let mut v: i64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return Err(RespError::BadInteger);
        }
        let d = i64::from(d - b'0');
        v = v
            .checked_mul(10)
            .and_then(|v| {
                if negative {
                    v.checked_sub(d)
                } else {
                    v.checked_add(d)
                }
            })
            .ok_or(RespError::BadInteger)?;
    }
    Ok(v)
}

/// A bulk or array length: -1 is nil (`None`).
fn length(
    digits: &[u8],
    max: usize,
    too_long: fn(i64) -> RespError,
) -> Result<Option<usize>, RespError> {
    match integer(digits)? {
        -1 => Ok(None),
        n if n < -1 => Err(RespError::NegativeLength(n)),
        n if n as u64 > max as u64 => Err(too_long(n)),
        n => Ok(Some(n as usize)),
    }
}

/// The head of the reply at the start of `buf` and the bytes it takes, or
/// `None` while it has not all arrived. A bulk string's body is not part of
/// its head.
pub fn parse_head(buf: &[u8]) -> Result<Option<(Head<'_>, usize)>, RespError> {
    let Some(&kind) = buf.first() else {
        return Ok(None);
    };
    if !matches!(kind, b'+' | b'-' | b':' | b'$' | b'*' | b'_') {
        return Err(RespError::UnknownType(kind));
    }
    let Some((text, used)) = line(&buf[1..])? else {
        return Ok(None);
    };
    let used = used + 1;
    let head = match kind {
        b'+' => Head::Simple(text),
        b'-' => Head::Error(text),
        b':' => Head::Integer(integer(text)?),
        b'$' => match length(text, MAX_BULK_BYTES, RespError::BulkTooLarge)? {
            Some(n) => Head::Bulk(n),
            None => Head::Nil,
        },
        b'*' => match length(text, MAX_ARRAY_LEN, RespError::ArrayTooLong)? {
            Some(n) => Head::Array(n),
            None => Head::Nil,
        },
        // RESP3's null: `_` and an empty line.
        _ if text.is_empty() => Head::Nil,
        _ => return Err(RespError::BadLineEnd),
    };
    Ok(Some((head, used)))
}

/// Checks the two bytes after a bulk body the caller read itself.
pub fn check_bulk_end(after_body: [u8; 2]) -> Result<(), RespError> {
    if after_body == *b"\r\n" {
        Ok(())
    } else {
        Err(RespError::BadBulkEnd)
    }
}

/// The whole reply at the start of `buf` and the bytes it takes, or `None`
/// while it has not all arrived.
pub fn parse_reply(buf: &[u8]) -> Result<Option<(Reply, usize)>, RespError> {
    reply_at(buf, 0)
}

fn reply_at(buf: &[u8], depth: usize) -> Result<Option<(Reply, usize)>, RespError> {
    let Some((head, mut used)) = parse_head(buf)? else {
        return Ok(None);
    };
    let reply = match head {
        Head::Simple(t) => Reply::Simple(t.to_vec()),
        Head::Error(t) => Reply::Error(t.to_vec()),
        Head::Integer(v) => Reply::Integer(v),
        Head::Nil => Reply::Nil,
        Head::Bulk(n) => {
            let Some(body) = buf.get(used..used + n + 2) else {
                return Ok(None);
            };
            check_bulk_end([body[n], body[n + 1]])?;
            used += n + 2;
            Reply::Bulk(body[..n].to_vec())
        }
        Head::Array(n) => {
            if depth >= MAX_DEPTH {
                return Err(RespError::TooDeep);
            }
            // Each element takes at least 3 bytes: never reserve more than
            // the bytes at hand could hold.
            let mut items = Vec::with_capacity(n.min((buf.len() - used) / 3 + 1));
            for _ in 0..n {
                let Some((item, took)) = reply_at(&buf[used..], depth + 1)? else {
                    return Ok(None);
                };
                items.push(item);
                used += took;
            }
            Reply::Array(items)
        }
    };
    Ok(Some((reply, used)))
}

fn push_len(out: &mut Vec<u8>, kind: u8, n: usize) {
    out.push(kind);
    out.extend_from_slice(n.to_string().as_bytes());
    out.extend_from_slice(CRLF);
}

/// Appends the command `args` (an array of bulk strings) to `out`.
pub fn encode(out: &mut Vec<u8>, args: &[&[u8]]) {
    push_len(out, b'*', args.len());
    for a in args {
        encode_bulk(out, a);
    }
}

/// Appends the command `args` followed by the head of one more argument of
/// `body_len` bytes, whose bytes the caller sends itself, then [`CRLF`].
pub fn encode_with_body(out: &mut Vec<u8>, args: &[&[u8]], body_len: usize) {
    encode_arguments(out, args, body_len, 0);
}

/// Appends the head of a command of `args`, one argument of `body_len`
/// bytes the caller sends itself (then [`CRLF`]), and `after` more
/// arguments the caller appends with [`encode_bulk`].
pub fn encode_arguments(out: &mut Vec<u8>, args: &[&[u8]], body_len: usize, after: usize) {
    push_len(out, b'*', args.len() + 1 + after);
    for a in args {
        encode_bulk(out, a);
    }
    push_len(out, b'$', body_len);
}

/// Appends one bulk string.
pub fn encode_bulk(out: &mut Vec<u8>, arg: &[u8]) {
    push_len(out, b'$', arg.len());
    out.extend_from_slice(arg);
    out.extend_from_slice(CRLF);
}

/// Appends `reply` as a server would send it (RESP2; nil as `$-1`). Status
/// and error lines must hold no CR or LF.
pub fn encode_reply(out: &mut Vec<u8>, reply: &Reply) {
    match reply {
        Reply::Simple(t) | Reply::Error(t) => {
            out.push(if matches!(reply, Reply::Simple(_)) {
                b'+'
            } else {
                b'-'
            });
            out.extend_from_slice(t);
            out.extend_from_slice(CRLF);
        }
        Reply::Integer(v) => {
            out.push(b':');
            out.extend_from_slice(v.to_string().as_bytes());
            out.extend_from_slice(CRLF);
        }
        Reply::Bulk(b) => {
            push_len(out, b'$', b.len());
            out.extend_from_slice(b);
            out.extend_from_slice(CRLF);
        }
        Reply::Nil => out.extend_from_slice(b"$-1\r\n"),
        Reply::Array(items) => {
            push_len(out, b'*', items.len());
            for item in items {
                encode_reply(out, item);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(bytes: &[u8]) -> Result<Option<(Reply, usize)>, RespError> {
        parse_reply(bytes)
    }

    #[test]
    fn every_reply_kind_parses() {
        assert_eq!(
            whole(b"+OK\r\n"),
            Ok(Some((Reply::Simple(b"OK".to_vec()), 5)))
        );
        assert_eq!(
            whole(b"-ERR no\r\nextra"),
            Ok(Some((Reply::Error(b"ERR no".to_vec()), 9)))
        );
        assert_eq!(whole(b":-42\r\n"), Ok(Some((Reply::Integer(-42), 6))));
        assert_eq!(
            whole(b"$3\r\na\r\n\r\n"),
            Ok(Some((Reply::Bulk(b"a\r\n".to_vec()), 9)))
        );
        assert_eq!(whole(b"$0\r\n\r\n"), Ok(Some((Reply::Bulk(Vec::new()), 6))));
        assert_eq!(whole(b"$-1\r\n"), Ok(Some((Reply::Nil, 5))));
        assert_eq!(whole(b"*-1\r\n"), Ok(Some((Reply::Nil, 5))));
        assert_eq!(whole(b"_\r\n"), Ok(Some((Reply::Nil, 3))));
        let slots = b"*1\r\n*3\r\n:0\r\n:16383\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n";
        let want = Reply::Array(vec![Reply::Array(vec![
            Reply::Integer(0),
            Reply::Integer(16383),
            Reply::Array(vec![
                Reply::Bulk(b"127.0.0.1".to_vec()),
                Reply::Integer(7000),
            ]),
        ])]);
        assert_eq!(whole(slots), Ok(Some((want, slots.len()))));
        assert_eq!(whole(b"*0\r\n"), Ok(Some((Reply::Array(Vec::new()), 4))));
    }

    #[test]
    fn a_reply_cut_anywhere_asks_for_more() {
        let mut all = Vec::new();
        let r = Reply::Array(vec![
            Reply::Bulk(vec![0, 13, 10, 255]),
            Reply::Nil,
            Reply::Integer(i64::MIN),
            Reply::Error(b"MOVED 3999 127.0.0.1:6381".to_vec()),
        ]);
        encode_reply(&mut all, &r);
        for cut in 0..all.len() {
            assert_eq!(whole(&all[..cut]), Ok(None), "cut at {cut}");
        }
        assert_eq!(whole(&all), Ok(Some((r, all.len()))));
    }

    #[test]
    fn heads_leave_bulk_bodies_to_the_caller() {
        assert_eq!(parse_head(b"$5\r\nhel"), Ok(Some((Head::Bulk(5), 4))));
        assert_eq!(parse_head(b"*2\r\n"), Ok(Some((Head::Array(2), 4))));
        assert_eq!(parse_head(b"$1"), Ok(None));
        assert_eq!(parse_head(b""), Ok(None));
        assert_eq!(check_bulk_end(*b"\r\n"), Ok(()));
        assert_eq!(check_bulk_end(*b"\n\r"), Err(RespError::BadBulkEnd));
    }

    #[test]
    fn broken_streams_are_errors() {
        assert_eq!(whole(b"?x\r\n"), Err(RespError::UnknownType(b'?')));
        assert_eq!(whole(b"+a\rb\r\n"), Err(RespError::BadLineEnd));
        assert_eq!(whole(b"+a\nb\r\n"), Err(RespError::BadLineEnd));
        assert_eq!(whole(b":\r\n"), Err(RespError::BadInteger));
        assert_eq!(whole(b":+1\r\n"), Err(RespError::BadInteger));
        assert_eq!(
            whole(b":99999999999999999999\r\n"),
            Err(RespError::BadInteger)
        );
        assert_eq!(whole(b"$-2\r\n"), Err(RespError::NegativeLength(-2)));
        assert_eq!(
            whole(b"$536870913\r\n"),
            Err(RespError::BulkTooLarge(536_870_913))
        );
        assert_eq!(
            whole(b"*1048577\r\n"),
            Err(RespError::ArrayTooLong(1_048_577))
        );
        assert_eq!(whole(b"$1\r\nab\r\n"), Err(RespError::BadBulkEnd));
        assert_eq!(whole(b"_x\r\n"), Err(RespError::BadLineEnd));
        let deep = b"*1\r\n".repeat(MAX_DEPTH + 1);
        assert_eq!(whole(&deep), Err(RespError::TooDeep));
        let long = [b"+".as_slice(), &vec![b'a'; MAX_LINE_BYTES + 2]].concat();
        assert_eq!(whole(&long), Err(RespError::LineTooLong));
        // At the limit, still waiting for the CRLF.
        let at_limit = [b"+".as_slice(), &vec![b'a'; MAX_LINE_BYTES]].concat();
        assert_eq!(whole(&at_limit), Ok(None));
        let mut ok = at_limit.clone();
        ok.extend_from_slice(CRLF);
        assert!(matches!(whole(&ok), Ok(Some((Reply::Simple(_), _)))));
    }

    #[test]
    fn a_huge_array_length_reserves_nothing_up_front() {
        // Only the bytes at hand bound the reservation; the parse waits.
        assert_eq!(whole(b"*1000000\r\n:1\r\n"), Ok(None));
    }

    #[test]
    fn commands_are_arrays_of_bulk_strings() {
        let mut out = Vec::new();
        encode(&mut out, &[b"EXISTS", b"m@0x00000001@0@ab"]);
        assert_eq!(out, b"*2\r\n$6\r\nEXISTS\r\n$17\r\nm@0x00000001@0@ab\r\n");
        let mut out = Vec::new();
        encode_with_body(&mut out, &[b"SET", b"k"], 4);
        out.extend_from_slice(b"\x00\x01\r\n");
        out.extend_from_slice(CRLF);
        assert_eq!(out, b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\n\x00\x01\r\n\r\n");
        let mut out = Vec::new();
        encode(&mut out, &[]);
        assert_eq!(out, b"*0\r\n");
    }
}
