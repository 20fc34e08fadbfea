//! Redis Cluster and Valkey Cluster routing, without I/O: which of the
//! [`SLOTS`] hash slots a key falls in ([`key_slot`]), which node serves a
//! slot ([`SlotMap`], read from a `CLUSTER SLOTS` or `CLUSTER SHARDS` reply),
//! and what a `MOVED` or `ASK` error says ([`parse_redirect`]).
//!
//! Replies from the server are never trusted: a reply of the wrong shape is
//! an `Err` or `None`, never a panic.

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::Reply;

/// Number of hash slots of a cluster.
pub const SLOTS: u16 = 16384;

/// CRC16 lookup table: CCITT polynomial 0x1021, most significant bit first.
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// CRC16-CCITT in its XMODEM form (polynomial 0x1021, initial value 0, no
/// reflection, no final XOR): the checksum cluster key hashing uses.
pub fn crc16(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16_TABLE[usize::from((crc >> 8) as u8 ^ b)]
    })
}

/// The hash slot of `key`. When the key holds a `{` followed later by a `}`
/// with at least one byte between the first `{` and the first `}` after it,
/// only those bytes (the hash tag) are hashed; otherwise the whole key is.
pub fn key_slot(key: &[u8]) -> u16 {
    let hashed = match key.iter().position(|&b| b == b'{') {
        Some(open) => {
            let after = key.get(open + 1..).unwrap_or_default();
            match after.iter().position(|&b| b == b'}') {
                Some(close) if close > 0 => after.get(..close).unwrap_or(key),
                _ => key,
            }
        }
        None => key,
    };
    crc16(hashed) % SLOTS
}

/// The address of a cluster node.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddr {
    /// Host name or IP address; an IPv6 address without brackets.
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl NodeAddr {
    /// Parses `host:port` or `[ipv6]:port`, splitting at the last `:` (so an
    /// unbracketed IPv6 address followed by its port, as `MOVED` writes it,
    /// parses too). The host must not be empty; the port must be decimal
    /// digits only, 1 to 65535.
    pub fn parse(s: &str) -> Option<NodeAddr> {
        let (host, port) = split_host_port(s)?;
        if host.is_empty() {
            return None;
        }
        Some(NodeAddr {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// `host:port` split at the last `:`, brackets taken off the host; the host
/// may be empty.
fn split_host_port(s: &str) -> Option<(&str, u16)> {
    let (host, port) = s.rsplit_once(':')?;
    let port = decimal_port(port.as_bytes())?;
    let host = match host.strip_prefix('[') {
        Some(inner) => {
            let inner = inner.strip_suffix(']')?;
            if inner.is_empty() {
                return None;
            }
            inner
        }
        None => host,
    };
    if host
        .chars()
        .any(|c| c == '[' || c == ']' || c.is_whitespace() || c.is_control())
    {
        return None;
    }
    Some((host, port))
}

/// A port written as 1 to 5 decimal digits, 1 to 65535.
fn decimal_port(digits: &[u8]) -> Option<u16> {
    if digits.is_empty() || digits.len() > 5 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let port = std::str::from_utf8(digits).ok()?.parse::<u16>().ok()?;
    (port != 0).then_some(port)
}

/// Which master serves each hash slot, and the replicas of each master.
///
/// Stored as sorted, non-overlapping slot ranges, each naming a master by
/// its index in [`SlotMap::masters`]; adjacent ranges of one master are kept
/// merged.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotMap {
    /// `(start, end, master index)`, inclusive, sorted by start.
    ranges: Vec<(u16, u16, usize)>,
    masters: Vec<NodeAddr>,
    /// Parallel to `masters`.
    replicas: Vec<Vec<NodeAddr>>,
}

impl SlotMap {
    /// A map in which no slot is covered.
    pub fn new() -> SlotMap {
        SlotMap::default()
    }

    /// The master serving `slot`, if any range covers it.
    pub fn master_of(&self, slot: u16) -> Option<&NodeAddr> {
        let after = self.ranges.partition_point(|&(start, _, _)| start <= slot);
        let &(_, end, master) = self.ranges.get(after.checked_sub(1)?)?;
        if slot <= end {
            self.masters.get(master)
        } else {
            None
        }
    }

    /// Every node this map has named as a master, in the order first named.
    /// A master that lost all its slots to [`SlotMap::set_slot`] stays listed.
    pub fn masters(&self) -> &[NodeAddr] {
        &self.masters
    }

    /// The replicas of `master`; empty for a node that is not a master here.
    pub fn replicas_of(&self, master: &NodeAddr) -> &[NodeAddr] {
        self.masters
            .iter()
            .position(|m| m == master)
            .and_then(|i| self.replicas.get(i))
            .map_or(&[], Vec::as_slice)
    }

    /// The slot ranges, in slot order: `(start, end, master)`, inclusive.
    pub fn ranges(&self) -> impl Iterator<Item = (u16, u16, &NodeAddr)> + '_ {
        self.ranges
            .iter()
            .filter_map(|&(start, end, master)| self.masters.get(master).map(|m| (start, end, m)))
    }

    /// How many slots some master serves.
    pub fn covered_slots(&self) -> u32 {
        self.ranges
            .iter()
            .map(|&(start, end, _)| u32::from(end) - u32::from(start) + 1)
            .sum()
    }

    /// Whether every one of the [`SLOTS`] slots has a master.
    pub fn is_complete(&self) -> bool {
        self.covered_slots() == u32::from(SLOTS)
    }

    /// Adds the slots `start..=end`, served by `master` with `replicas`
    /// (added to those `master` already has, without repeats). Refused when
    /// the range is empty, reaches past the last slot, or overlaps a range
    /// already in the map.
    pub fn add_range(
        &mut self,
        start: u16,
        end: u16,
        master: NodeAddr,
        replicas: Vec<NodeAddr>,
    ) -> Result<(), String> {
        check_range(start, end)?;
        let at = self.ranges.partition_point(|&(s, _, _)| s < start);
        if let Some(&(s, e, _)) = at.checked_sub(1).and_then(|i| self.ranges.get(i)) {
            if e >= start {
                return Err(overlap((s, e), (start, end)));
            }
        }
        if let Some(&(s, e, _)) = self.ranges.get(at) {
            if s <= end {
                return Err(overlap((start, end), (s, e)));
            }
        }
        let index = self.master_index(master);
        if let (Some(own), Some(master)) = (self.replicas.get_mut(index), self.masters.get(index)) {
            for r in replicas {
                if r != *master && !own.contains(&r) {
                    own.push(r);
                }
            }
        }
        self.ranges.insert(at, (start, end, index));
        self.merge_around(at);
        Ok(())
    }

    /// Points `slot` at `master` (after a `MOVED` redirect), splitting the
    /// range that covered it and adding `master` to the masters when new. A
    /// slot past the last one is ignored.
    pub fn set_slot(&mut self, slot: u16, master: NodeAddr) {
        if slot >= SLOTS {
            return;
        }
        let index = self.master_index(master);
        let after = self.ranges.partition_point(|&(start, _, _)| start <= slot);
        let covering = after
            .checked_sub(1)
            .and_then(|i| self.ranges.get(i).map(|&r| (i, r)))
            .filter(|&(_, (_, end, _))| slot <= end);
        let at = match covering {
            Some((_, (_, _, old))) if old == index => return,
            Some((i, (start, end, old))) => {
                let mut parts = Vec::with_capacity(3);
                if start < slot {
                    parts.push((start, slot - 1, old));
                }
                let at = i + parts.len();
                parts.push((slot, slot, index));
                if slot < end {
                    parts.push((slot + 1, end, old));
                }
                self.ranges.splice(i..=i, parts);
                at
            }
            None => {
                self.ranges.insert(after, (slot, slot, index));
                after
            }
        };
        self.merge_around(at);
    }

    /// The index of `master` in `masters`, added (with no replicas) if new.
    fn master_index(&mut self, master: NodeAddr) -> usize {
        match self.masters.iter().position(|m| *m == master) {
            Some(i) => i,
            None => {
                self.masters.push(master);
                self.replicas.push(Vec::new());
                self.masters.len() - 1
            }
        }
    }

    /// Merges the range at `i` with its neighbours when they are adjacent
    /// and have the same master.
    fn merge_around(&mut self, i: usize) {
        if let (Some(&(_, end, m)), Some(&(next_start, next_end, next_m))) =
            (self.ranges.get(i), self.ranges.get(i + 1))
        {
            if m == next_m && u32::from(end) + 1 == u32::from(next_start) {
                if let Some(r) = self.ranges.get_mut(i) {
                    r.1 = next_end;
                }
                self.ranges.remove(i + 1);
            }
        }
        let Some(prev) = i.checked_sub(1) else {
            return;
        };
        if let (Some(&(_, prev_end, prev_m)), Some(&(start, end, m))) =
            (self.ranges.get(prev), self.ranges.get(i))
        {
            if m == prev_m && u32::from(prev_end) + 1 == u32::from(start) {
                if let Some(r) = self.ranges.get_mut(prev) {
                    r.1 = end;
                }
                self.ranges.remove(i);
            }
        }
    }
}

fn check_range(start: u16, end: u16) -> Result<(), String> {
    if end >= SLOTS {
        Err(format!(
            "slot range {start}-{end} reaches past the last slot {}",
            SLOTS - 1
        ))
    } else if start > end {
        Err(format!("slot range {start}-{end} starts after its end"))
    } else {
        Ok(())
    }
}

fn overlap(a: (u16, u16), b: (u16, u16)) -> String {
    format!("slot ranges {}-{} and {}-{} overlap", a.0, a.1, b.0, b.1)
}

/// Collects a reply's ranges and nodes, then checks and sorts them at once
/// (a reply may list many ranges, in any order).
#[derive(Default)]
struct Builder {
    ranges: Vec<(u16, u16, usize)>,
    masters: Vec<NodeAddr>,
    replicas: Vec<Vec<NodeAddr>>,
    index: HashMap<NodeAddr, usize>,
    seen_replicas: HashSet<(usize, NodeAddr)>,
}

impl Builder {
    fn add(
        &mut self,
        start: u16,
        end: u16,
        master: NodeAddr,
        replicas: Vec<NodeAddr>,
    ) -> Result<(), String> {
        check_range(start, end)?;
        let index = match self.index.get(&master) {
            Some(&i) => i,
            None => {
                let i = self.masters.len();
                self.index.insert(master.clone(), i);
                self.masters.push(master.clone());
                self.replicas.push(Vec::new());
                i
            }
        };
        for r in replicas {
            if r != master && self.seen_replicas.insert((index, r.clone())) {
                if let Some(own) = self.replicas.get_mut(index) {
                    own.push(r);
                }
            }
        }
        self.ranges.push((start, end, index));
        Ok(())
    }

    fn finish(mut self) -> Result<SlotMap, String> {
        self.ranges.sort_unstable();
        let mut ranges: Vec<(u16, u16, usize)> = Vec::with_capacity(self.ranges.len());
        for (start, end, master) in self.ranges {
            match ranges.last_mut() {
                Some(last) if last.1 >= start => {
                    return Err(overlap((last.0, last.1), (start, end)));
                }
                Some(last) if last.2 == master && u32::from(last.1) + 1 == u32::from(start) => {
                    last.1 = end;
                }
                _ => ranges.push((start, end, master)),
            }
        }
        Ok(SlotMap {
            ranges,
            masters: self.masters,
            replicas: self.replicas,
        })
    }
}

/// The bytes of a bulk string or status line.
fn text(r: &Reply) -> Option<&[u8]> {
    match r {
        Reply::Bulk(b) | Reply::Simple(b) => Some(b),
        _ => None,
    }
}

/// An integer, or a bulk string or status line holding a decimal one.
fn int(r: &Reply) -> Option<i64> {
    match r {
        Reply::Integer(v) => Some(*v),
        Reply::Bulk(b) | Reply::Simple(b) => {
            let digits = b.strip_prefix(b"-").unwrap_or(b);
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            std::str::from_utf8(b).ok()?.parse().ok()
        }
        _ => None,
    }
}

/// What a reply is, for error messages.
fn kind(r: &Reply) -> &'static str {
    match r {
        Reply::Simple(_) => "a status line",
        Reply::Error(_) => "an error",
        Reply::Integer(_) => "an integer",
        Reply::Bulk(_) => "a bulk string",
        Reply::Nil => "nil",
        Reply::Array(_) => "an array",
    }
}

/// The elements of a reply that must be an array; an error reply's text is
/// passed on.
fn array<'a>(r: &'a Reply, what: &str) -> Result<&'a [Reply], String> {
    match r {
        Reply::Array(items) => Ok(items),
        Reply::Error(e) => Err(format!(
            "{what}: the server answered -{}",
            String::from_utf8_lossy(e)
        )),
        other => Err(format!("{what} is {}, not an array", kind(other))),
    }
}

fn slot(r: &Reply, what: &str) -> Result<u16, String> {
    match int(r) {
        Some(v) if (0..i64::from(SLOTS)).contains(&v) => {
            u16::try_from(v).map_err(|_| format!("{what} {v} is not a slot"))
        }
        Some(v) => Err(format!("{what} {v} is not a slot (0 to {})", SLOTS - 1)),
        None => Err(format!("{what} is {}, not an integer", kind(r))),
    }
}

/// A port from an integer reply value: `None` for 0 or nil (no such port).
fn port(r: &Reply, what: &str) -> Result<Option<u16>, String> {
    match int(r) {
        None if *r == Reply::Nil => Ok(None),
        Some(0) => Ok(None),
        Some(v) => u16::try_from(v)
            .map(Some)
            .map_err(|_| format!("{what} {v} is not a port")),
        None => Err(format!("{what} is {}, not an integer", kind(r))),
    }
}

/// A host from reply bytes: empty or `?` stands for `default_host`.
fn host(bytes: &[u8], default_host: &str, what: &str) -> Result<String, String> {
    if bytes.is_empty() || bytes == b"?" {
        return Ok(default_host.to_owned());
    }
    String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
}

/// One node of a `CLUSTER SLOTS` entry: `[host, port, ...]`; `None` when it
/// names no port.
fn slots_node(r: &Reply, default_host: &str) -> Result<Option<NodeAddr>, String> {
    let fields = array(r, "a CLUSTER SLOTS node")?;
    let (Some(h), Some(p)) = (fields.first(), fields.get(1)) else {
        return Err(format!(
            "a CLUSTER SLOTS node has {} fields, not at least host and port",
            fields.len()
        ));
    };
    let host = match h {
        Reply::Nil => default_host.to_owned(),
        other => match text(other) {
            Some(b) => host(b, default_host, "a CLUSTER SLOTS host")?,
            None => {
                return Err(format!(
                    "a CLUSTER SLOTS host is {}, not a string",
                    kind(other)
                ))
            }
        },
    };
    Ok(port(p, "a CLUSTER SLOTS port")?.map(|port| NodeAddr { host, port }))
}

/// Reads the reply of `CLUSTER SLOTS`: entries `[start, end, master,
/// replica...]`, each node `[host, port, id?, metadata?...]` (fields after
/// the port are ignored). A nil, empty or `?` host means the endpoint the
/// command was sent to: `default_host`. A replica with port 0 is left out.
/// Ranges must lie within the slots, start at or before their end, and not
/// overlap.
pub fn parse_cluster_slots(reply: &Reply, default_host: &str) -> Result<SlotMap, String> {
    let mut map = Builder::default();
    for entry in array(reply, "the CLUSTER SLOTS reply")? {
        let fields = array(entry, "a CLUSTER SLOTS entry")?;
        let [start, end, master, replicas @ ..] = fields else {
            return Err(format!(
                "a CLUSTER SLOTS entry has {} fields, not at least start, end and master",
                fields.len()
            ));
        };
        let start = slot(start, "a CLUSTER SLOTS range start")?;
        let end = slot(end, "a CLUSTER SLOTS range end")?;
        let Some(master) = slots_node(master, default_host)? else {
            return Err(format!("the master of slots {start}-{end} has port 0"));
        };
        let mut known = Vec::with_capacity(replicas.len());
        for r in replicas {
            known.extend(slots_node(r, default_host)?);
        }
        map.add(start, end, master, known)?;
    }
    map.finish()
}

/// Pairs of a flat `[key, value, key, value...]` array; keys must be strings.
fn pairs<'a>(items: &'a [Reply], what: &str) -> Result<Vec<(&'a [u8], &'a Reply)>, String> {
    let chunks = items.chunks_exact(2);
    if !chunks.remainder().is_empty() {
        return Err(format!(
            "{what} has an odd number of fields ({})",
            items.len()
        ));
    }
    chunks
        .map(|kv| match kv {
            [k, v] => text(k)
                .map(|k| (k, v))
                .ok_or_else(|| format!("{what} has a key that is {}", kind(k))),
            _ => Err(format!("{what} is cut short")),
        })
        .collect()
}

/// The fields of one `CLUSTER SHARDS` node that routing uses.
struct ShardNode {
    addr: Option<NodeAddr>,
    master: bool,
    online: bool,
}

fn shards_node(r: &Reply, default_host: &str, prefer_tls: bool) -> Result<ShardNode, String> {
    let what = "a CLUSTER SHARDS node";
    let mut tcp = None;
    let mut tls = None;
    let mut ip: &[u8] = b"";
    let mut endpoint: &[u8] = b"";
    let mut master = false;
    let mut online = false;
    for (key, value) in pairs(array(r, what)?, what)? {
        let string = || match value {
            Reply::Nil => Ok(&b""[..]),
            v => text(v).ok_or_else(|| {
                format!(
                    "the {} of a CLUSTER SHARDS node is {}",
                    String::from_utf8_lossy(key),
                    kind(v)
                )
            }),
        };
        match key {
            b"port" => tcp = port(value, "a CLUSTER SHARDS port")?,
            b"tls-port" => tls = port(value, "a CLUSTER SHARDS tls-port")?,
            b"ip" => ip = string()?,
            b"endpoint" => endpoint = string()?,
            b"role" => master = matches!(string()?, b"master" | b"primary"),
            b"health" => online = string()? == b"online",
            _ => {}
        }
    }
    let port = if prefer_tls { tls.or(tcp) } else { tcp };
    let shown = if endpoint.is_empty() || endpoint == b"?" {
        ip
    } else {
        endpoint
    };
    let addr = match port {
        Some(port) => Some(NodeAddr {
            host: host(shown, default_host, "a CLUSTER SHARDS endpoint")?,
            port,
        }),
        None => None,
    };
    Ok(ShardNode {
        addr,
        master,
        online,
    })
}

/// Reads the reply of `CLUSTER SHARDS` (Redis 7, Valkey) in RESP2: shards
/// as flat key/value arrays whose `slots` are `[start, end, start, end...]`
/// (integers, or strings holding decimals) and whose `nodes` are flat
/// key/value arrays; other keys are ignored.
///
/// A shard serving no slots is skipped. Its master is the node whose role
/// is `master` (the first online one when several claim it). A node's host
/// is its `endpoint` unless that is empty or `?`, then its `ip`, then
/// `default_host`; its port is `port`, or with `prefer_tls` its `tls-port`
/// when it has one, else `port`. Replicas that are not `online` or have no
/// port are left out. Ranges must lie within the slots, start at or before
/// their end, and not overlap.
pub fn parse_cluster_shards(
    reply: &Reply,
    default_host: &str,
    prefer_tls: bool,
) -> Result<SlotMap, String> {
    let mut map = Builder::default();
    for shard in array(reply, "the CLUSTER SHARDS reply")? {
        let what = "a CLUSTER SHARDS shard";
        let mut slots: &[Reply] = &[];
        let mut nodes: &[Reply] = &[];
        for (key, value) in pairs(array(shard, what)?, what)? {
            match key {
                b"slots" => slots = array(value, "the slots of a CLUSTER SHARDS shard")?,
                b"nodes" => nodes = array(value, "the nodes of a CLUSTER SHARDS shard")?,
                _ => {}
            }
        }
        if slots.is_empty() {
            continue;
        }
        let bounds = slots.chunks_exact(2);
        if !bounds.remainder().is_empty() {
            return Err(format!(
                "a CLUSTER SHARDS shard lists {} slot bounds, not pairs",
                slots.len()
            ));
        }
        let mut ranges = Vec::with_capacity(slots.len() / 2);
        for pair in bounds {
            let [start, end] = pair else {
                return Err("a CLUSTER SHARDS slot range is cut short".to_owned());
            };
            ranges.push((
                slot(start, "a CLUSTER SHARDS range start")?,
                slot(end, "a CLUSTER SHARDS range end")?,
            ));
        }
        let mut masters = Vec::new();
        let mut replicas = Vec::new();
        for node in nodes {
            let node = shards_node(node, default_host, prefer_tls)?;
            if node.master {
                masters.push(node);
            } else if node.online {
                replicas.extend(node.addr);
            }
        }
        let chosen = masters
            .iter()
            .position(|m| m.online)
            .or((!masters.is_empty()).then_some(0));
        let (first_start, first_end) = ranges.first().copied().unwrap_or_default();
        let Some(master) = chosen.and_then(|i| masters.get(i)) else {
            return Err(format!(
                "the CLUSTER SHARDS shard of slots {first_start}-{first_end} has no master"
            ));
        };
        let Some(master) = master.addr.clone() else {
            return Err(format!(
                "the master of slots {first_start}-{first_end} has no {}port",
                if prefer_tls { "tls-port or " } else { "" }
            ));
        };
        for (start, end) in ranges {
            map.add(start, end, master.clone(), replicas.clone())?;
        }
    }
    map.finish()
}

/// Where a cluster error sends a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redirect {
    /// `MOVED`: `slot` now lives on `to`; update the slot map and resend.
    Moved {
        /// The slot of the command's key.
        slot: u16,
        /// The node serving it.
        to: NodeAddr,
    },
    /// `ASK`: send this one command to `to`, preceded by `ASKING`.
    Ask {
        /// The slot of the command's key.
        slot: u16,
        /// The node importing it.
        to: NodeAddr,
    },
}

/// Reads `MOVED <slot> <host>:<port>` or `ASK <slot> <host>:<port>` (an
/// error line, with or without its leading `-`). An empty or `?` host (a
/// node without a known endpoint) stands for `default_host`. Anything else
/// is `None`.
pub fn parse_redirect(error_line: &[u8], default_host: &str) -> Option<Redirect> {
    let line = error_line.strip_prefix(b"-").unwrap_or(error_line);
    let line = std::str::from_utf8(line).ok()?;
    let mut words = line.split(' ');
    let (Some(word), Some(slot), Some(endpoint), None) =
        (words.next(), words.next(), words.next(), words.next())
    else {
        return None;
    };
    if slot.is_empty() || slot.len() > 5 || !slot.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let slot: u16 = slot.parse().ok()?;
    if slot >= SLOTS {
        return None;
    }
    let (host, port) = split_host_port(endpoint)?;
    let host = if host.is_empty() || host == "?" {
        default_host
    } else {
        host
    };
    let to = NodeAddr {
        host: host.to_owned(),
        port,
    };
    match word {
        "MOVED" => Some(Redirect::Moved { slot, to }),
        "ASK" => Some(Redirect::Ask { slot, to }),
        _ => None,
    }
}

/// Whether an error line starts with the word `word`, after an optional `-`.
fn starts_with_word(error_line: &[u8], word: &[u8]) -> bool {
    let line = error_line.strip_prefix(b"-").unwrap_or(error_line);
    match line.strip_prefix(word) {
        Some(rest) => rest.is_empty() || rest.starts_with(b" "),
        None => false,
    }
}

/// Whether an error line is `CLUSTERDOWN ...`: the cluster cannot serve
/// the slot now.
pub fn is_cluster_down(error_line: &[u8]) -> bool {
    starts_with_word(error_line, b"CLUSTERDOWN")
}

/// Whether an error line is `TRYAGAIN ...`: a multi-key command's keys are
/// mid-migration; retry later.
pub fn is_try_again(error_line: &[u8]) -> bool {
    starts_with_word(error_line, b"TRYAGAIN")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_reply;

    fn bulk(s: &str) -> Reply {
        Reply::Bulk(s.as_bytes().to_vec())
    }

    fn int(v: i64) -> Reply {
        Reply::Integer(v)
    }

    fn arr(items: Vec<Reply>) -> Reply {
        Reply::Array(items)
    }

    fn addr(s: &str) -> NodeAddr {
        NodeAddr::parse(s).expect("test address")
    }

    fn ranges(map: &SlotMap) -> Vec<(u16, u16, String)> {
        map.ranges()
            .map(|(s, e, m)| (s, e, m.to_string()))
            .collect()
    }

    fn whole(bytes: &[u8]) -> Reply {
        match parse_reply(bytes) {
            Ok(Some((reply, used))) if used == bytes.len() => reply,
            other => panic!("not one whole reply: {other:?}"),
        }
    }

    // CLUSTER SLOTS and CLUSTER SHARDS replies as Redis 7.0 sends them, from
    // a cluster of masters :17001 (slots 0-8191, replica :17003) and :17002
    // (slots 8192-16383).
    const SLOTS_IP: &[u8] = b"*2\r\n*4\r\n:0\r\n:8191\r\n\
        *4\r\n$9\r\n127.0.0.1\r\n:17001\r\n$40\r\n220f2cadeb8e862e49e2da3c65fa9dd844eed5dd\r\n*0\r\n\
        *4\r\n$9\r\n127.0.0.1\r\n:17003\r\n$40\r\nec3a043cc4b89fc2079004434b5a6057921009bc\r\n*0\r\n\
        *3\r\n:8192\r\n:16383\r\n\
        *4\r\n$9\r\n127.0.0.1\r\n:17002\r\n$40\r\ndf384b691cb5bf3f130fe51257b18f4792b45ce2\r\n*0\r\n";

    // The same with `cluster-preferred-endpoint-type unknown-endpoint`: nil
    // hosts, the IP in the metadata map.
    const SLOTS_UNKNOWN_ENDPOINT: &[u8] = b"*2\r\n*4\r\n:0\r\n:8191\r\n\
        *4\r\n$-1\r\n:17001\r\n$40\r\n220f2cadeb8e862e49e2da3c65fa9dd844eed5dd\r\n\
        *2\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n\
        *4\r\n$-1\r\n:17003\r\n$40\r\nec3a043cc4b89fc2079004434b5a6057921009bc\r\n\
        *2\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n\
        *3\r\n:8192\r\n:16383\r\n\
        *4\r\n$-1\r\n:17002\r\n$40\r\ndf384b691cb5bf3f130fe51257b18f4792b45ce2\r\n\
        *2\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n";

    // `cluster-preferred-endpoint-type hostname` with no hostnames set.
    const SLOTS_NO_HOSTNAME: &[u8] = b"*1\r\n*3\r\n:0\r\n:16383\r\n\
        *4\r\n$1\r\n?\r\n:17001\r\n$40\r\n220f2cadeb8e862e49e2da3c65fa9dd844eed5dd\r\n\
        *2\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n";

    // CLUSTER SHARDS while the replica :17003 is still loading.
    const SHARDS_LOADING: &[u8] = b"*2\r\n*4\r\n$5\r\nslots\r\n*2\r\n:0\r\n:8191\r\n$5\r\nnodes\r\n*2\r\n\
        *14\r\n$2\r\nid\r\n$40\r\n220f2cadeb8e862e49e2da3c65fa9dd844eed5dd\r\n$4\r\nport\r\n:17001\r\n\
        $2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n\
        $18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$6\r\nonline\r\n\
        *14\r\n$2\r\nid\r\n$40\r\nec3a043cc4b89fc2079004434b5a6057921009bc\r\n$4\r\nport\r\n:17003\r\n\
        $2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$7\r\nreplica\r\n\
        $18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$7\r\nloading\r\n\
        *4\r\n$5\r\nslots\r\n*2\r\n:8192\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n\
        *14\r\n$2\r\nid\r\n$40\r\ndf384b691cb5bf3f130fe51257b18f4792b45ce2\r\n$4\r\nport\r\n:17002\r\n\
        $2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$9\r\n127.0.0.1\r\n$4\r\nrole\r\n$6\r\nmaster\r\n\
        $18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$6\r\nonline\r\n";

    // CLUSTER SHARDS with `unknown-endpoint`, the replica online: empty
    // endpoints.
    const SHARDS_UNKNOWN_ENDPOINT: &[u8] = b"*2\r\n*4\r\n$5\r\nslots\r\n*2\r\n:0\r\n:8191\r\n$5\r\nnodes\r\n*2\r\n\
        *14\r\n$2\r\nid\r\n$40\r\n220f2cadeb8e862e49e2da3c65fa9dd844eed5dd\r\n$4\r\nport\r\n:17001\r\n\
        $2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$0\r\n\r\n$4\r\nrole\r\n$6\r\nmaster\r\n\
        $18\r\nreplication-offset\r\n:28\r\n$6\r\nhealth\r\n$6\r\nonline\r\n\
        *14\r\n$2\r\nid\r\n$40\r\nec3a043cc4b89fc2079004434b5a6057921009bc\r\n$4\r\nport\r\n:17003\r\n\
        $2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$0\r\n\r\n$4\r\nrole\r\n$7\r\nreplica\r\n\
        $18\r\nreplication-offset\r\n:28\r\n$6\r\nhealth\r\n$6\r\nonline\r\n\
        *4\r\n$5\r\nslots\r\n*2\r\n:8192\r\n:16383\r\n$5\r\nnodes\r\n*1\r\n\
        *14\r\n$2\r\nid\r\n$40\r\ndf384b691cb5bf3f130fe51257b18f4792b45ce2\r\n$4\r\nport\r\n:17002\r\n\
        $2\r\nip\r\n$9\r\n127.0.0.1\r\n$8\r\nendpoint\r\n$0\r\n\r\n$4\r\nrole\r\n$6\r\nmaster\r\n\
        $18\r\nreplication-offset\r\n:0\r\n$6\r\nhealth\r\n$6\r\nonline\r\n";

    #[test]
    fn crc16_is_xmodem() {
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(crc16(b""), 0);
        assert_eq!(crc16(b"A"), 0x58E5);
    }

    #[test]
    fn key_slots_match_cluster_keyslot() {
        // The values `CLUSTER KEYSLOT` gives for these keys.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"somekey"), 11058);
        assert_eq!(key_slot(b"hello"), 866);
        assert_eq!(key_slot(b""), 0);
        assert_eq!(key_slot(b"{user1000}.following"), 3443);
        assert_eq!(
            key_slot(b"{user1000}.following"),
            key_slot(b"{user1000}.followers")
        );
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        // An empty tag: the whole key is hashed.
        assert_eq!(key_slot(b"foo{}{bar}"), 8363);
        assert_eq!(key_slot(b"foo{}{bar}"), crc16(b"foo{}{bar}") % SLOTS);
        assert_eq!(key_slot(b"{}"), 15257);
        assert_eq!(key_slot(b"{}"), crc16(b"{}") % SLOTS);
        // The tag runs from the first `{` to the first `}` after it.
        assert_eq!(key_slot(b"foo{{bar}}zap"), 4015);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
        assert_eq!(key_slot(b"foo{bar}{zap}"), 5061);
        assert_eq!(key_slot(b"foo{bar}{zap}"), key_slot(b"bar"));
        // A `}` before the first `{` does not count.
        assert_eq!(key_slot(b"}{a}"), 15495);
        assert_eq!(key_slot(b"}{a}"), key_slot(b"a"));
        // No closing `}`: the whole key.
        assert_eq!(key_slot(b"a{b"), 13340);
        assert_eq!(key_slot(b"a{b"), crc16(b"a{b") % SLOTS);
        assert_eq!(key_slot(b"{"), crc16(b"{") % SLOTS);
        assert!(key_slot(&[0xff; 100]) < SLOTS);
    }

    #[test]
    fn node_addresses_parse_and_print() {
        let a = addr("127.0.0.1:6379");
        assert_eq!(a.host, "127.0.0.1");
        assert_eq!(a.port, 6379);
        assert_eq!(a.to_string(), "127.0.0.1:6379");
        let b = addr("[::1]:6380");
        assert_eq!((b.host.as_str(), b.port), ("::1", 6380));
        assert_eq!(b.to_string(), "[::1]:6380");
        // As MOVED writes an IPv6 address: no brackets.
        assert_eq!(addr("fe80::1:7000"), addr("[fe80::1]:7000"));
        assert_eq!(addr("redis-0.redis.svc:65535").port, 65535);
        assert_eq!(NodeAddr::parse(&b.to_string()), Some(b));
        for bad in [
            "",
            "host",
            "host:",
            ":6379",
            "[]:6379",
            "[::1:6379",
            "::1]:6379",
            "a]b:1",
            "host:0",
            "host:65536",
            "host:+1",
            "host:-1",
            "host:00000006379",
            "host: 1",
            "a b:1",
            "a\r:1",
        ] {
            assert_eq!(NodeAddr::parse(bad), None, "{bad:?}");
        }
        assert!(addr("a:1") < addr("a:2"));
        assert!(addr("a:2") < addr("b:1"));
    }

    #[test]
    fn an_empty_map_covers_nothing() {
        let map = SlotMap::new();
        assert_eq!(map.master_of(0), None);
        assert_eq!(map.master_of(SLOTS - 1), None);
        assert_eq!(map.master_of(u16::MAX), None);
        assert_eq!(map.covered_slots(), 0);
        assert!(!map.is_complete());
        assert!(map.masters().is_empty());
        assert!(map.replicas_of(&addr("a:1")).is_empty());
    }

    #[test]
    fn ranges_are_added_and_looked_up() {
        let mut map = SlotMap::new();
        let (a, b) = (addr("a:1"), addr("b:1"));
        map.add_range(100, 199, a.clone(), vec![addr("ar:1"), a.clone()])
            .unwrap();
        map.add_range(0, 99, b.clone(), vec![]).unwrap();
        map.add_range(200, 299, a.clone(), vec![addr("ar:1"), addr("ar:2")])
            .unwrap();
        assert_eq!(
            ranges(&map),
            [(0, 99, "b:1".into()), (100, 299, "a:1".into())]
        );
        assert_eq!(map.master_of(0), Some(&b));
        assert_eq!(map.master_of(99), Some(&b));
        assert_eq!(map.master_of(100), Some(&a));
        assert_eq!(map.master_of(299), Some(&a));
        assert_eq!(map.master_of(300), None);
        assert_eq!(map.masters(), [a.clone(), b.clone()]);
        assert_eq!(map.replicas_of(&a), [addr("ar:1"), addr("ar:2")]);
        assert!(map.replicas_of(&b).is_empty());
        assert_eq!(map.covered_slots(), 300);
        for (s, e) in [(0, 0), (99, 100), (299, 299), (50, 400), (300, 200)] {
            assert!(map.add_range(s, e, addr("c:1"), vec![]).is_err(), "{s}-{e}");
        }
        assert!(map.add_range(300, SLOTS, addr("c:1"), vec![]).is_err());
        map.add_range(300, SLOTS - 1, addr("c:1"), vec![]).unwrap();
        assert!(map.is_complete());
        assert_eq!(map.master_of(SLOTS - 1), Some(&addr("c:1")));
        assert_eq!(map.master_of(SLOTS), None);
    }

    fn three_ranges() -> SlotMap {
        let mut map = SlotMap::new();
        map.add_range(0, 99, addr("a:1"), vec![]).unwrap();
        map.add_range(100, 199, addr("b:1"), vec![addr("br:1")])
            .unwrap();
        map.add_range(200, 299, addr("c:1"), vec![]).unwrap();
        map
    }

    #[test]
    fn set_slot_splits_a_range_in_its_middle() {
        let mut map = three_ranges();
        map.set_slot(150, addr("n:1"));
        assert_eq!(
            ranges(&map),
            [
                (0, 99, "a:1".into()),
                (100, 149, "b:1".into()),
                (150, 150, "n:1".into()),
                (151, 199, "b:1".into()),
                (200, 299, "c:1".into()),
            ]
        );
        assert_eq!(map.master_of(150), Some(&addr("n:1")));
        assert_eq!(map.master_of(149), Some(&addr("b:1")));
        assert_eq!(map.master_of(151), Some(&addr("b:1")));
        assert_eq!(map.covered_slots(), 300);
        assert_eq!(map.masters().last(), Some(&addr("n:1")));
        assert!(map.replicas_of(&addr("n:1")).is_empty());
        assert_eq!(map.replicas_of(&addr("b:1")), [addr("br:1")]);
        // Back to its old master: the range is whole again.
        map.set_slot(150, addr("b:1"));
        assert_eq!(ranges(&map), ranges(&three_ranges()));
    }

    #[test]
    fn set_slot_splits_a_range_at_its_start_and_end() {
        let mut map = three_ranges();
        map.set_slot(100, addr("n:1"));
        map.set_slot(199, addr("n:1"));
        assert_eq!(
            ranges(&map),
            [
                (0, 99, "a:1".into()),
                (100, 100, "n:1".into()),
                (101, 198, "b:1".into()),
                (199, 199, "n:1".into()),
                (200, 299, "c:1".into()),
            ]
        );
        assert_eq!(map.masters().len(), 4);
        // To a neighbour's master: it joins the neighbour's range.
        let mut map = three_ranges();
        map.set_slot(100, addr("a:1"));
        map.set_slot(199, addr("c:1"));
        assert_eq!(
            ranges(&map),
            [
                (0, 100, "a:1".into()),
                (101, 198, "b:1".into()),
                (199, 299, "c:1".into()),
            ]
        );
        // The first and last slots of the map.
        let mut map = three_ranges();
        map.set_slot(0, addr("n:1"));
        map.set_slot(299, addr("n:1"));
        assert_eq!(map.master_of(0), Some(&addr("n:1")));
        assert_eq!(map.master_of(1), Some(&addr("a:1")));
        assert_eq!(map.master_of(298), Some(&addr("c:1")));
        assert_eq!(map.master_of(299), Some(&addr("n:1")));
        assert_eq!(map.covered_slots(), 300);
    }

    #[test]
    fn set_slot_on_single_and_uncovered_slots() {
        let mut map = SlotMap::new();
        map.add_range(5, 5, addr("a:1"), vec![]).unwrap();
        map.set_slot(5, addr("b:1"));
        assert_eq!(ranges(&map), [(5, 5, "b:1".into())]);
        // Its own master already: nothing changes.
        map.set_slot(5, addr("b:1"));
        assert_eq!(ranges(&map), [(5, 5, "b:1".into())]);
        // Uncovered slots are added, merged with their neighbours.
        map.set_slot(4, addr("b:1"));
        map.set_slot(7, addr("b:1"));
        map.set_slot(6, addr("b:1"));
        map.set_slot(SLOTS - 1, addr("c:1"));
        map.set_slot(0, addr("c:1"));
        assert_eq!(
            ranges(&map),
            [
                (0, 0, "c:1".into()),
                (4, 7, "b:1".into()),
                (SLOTS - 1, SLOTS - 1, "c:1".into()),
            ]
        );
        assert_eq!(map.covered_slots(), 6);
        // Past the last slot: ignored.
        map.set_slot(SLOTS, addr("d:1"));
        map.set_slot(u16::MAX, addr("d:1"));
        assert_eq!(map.covered_slots(), 6);
        assert!(!map.masters().contains(&addr("d:1")));
        // a:1 lost its only slot but stays listed.
        assert_eq!(map.masters()[0], addr("a:1"));
        // Every slot moved one by one: one range.
        let mut map = SlotMap::new();
        for slot in (0..SLOTS).rev() {
            map.set_slot(slot, addr("z:1"));
        }
        assert!(map.is_complete());
        assert_eq!(ranges(&map), [(0, SLOTS - 1, "z:1".into())]);
    }

    fn slots_node(host: Reply, port: i64) -> Reply {
        arr(vec![
            host,
            int(port),
            bulk("09dbe9720cda62f7865eabc5fd8857c5d2678366"),
            arr(vec![bulk("hostname"), bulk("host-1.redis.example.com")]),
        ])
    }

    #[test]
    fn cluster_slots_replies_parse() {
        // The shape of the CLUSTER SLOTS documentation's example.
        let reply = arr(vec![
            arr(vec![
                int(0),
                int(5460),
                slots_node(bulk("127.0.0.1"), 30001),
                slots_node(bulk("127.0.0.1"), 30004),
            ]),
            arr(vec![
                int(5461),
                int(10922),
                slots_node(bulk("127.0.0.1"), 30002),
                slots_node(bulk("127.0.0.1"), 30005),
            ]),
            arr(vec![
                int(10923),
                int(16383),
                slots_node(bulk("127.0.0.1"), 30003),
                slots_node(bulk("127.0.0.1"), 30006),
            ]),
        ]);
        let map = parse_cluster_slots(&reply, "10.0.0.1").unwrap();
        assert!(map.is_complete());
        assert_eq!(map.master_of(0), Some(&addr("127.0.0.1:30001")));
        assert_eq!(map.master_of(5461), Some(&addr("127.0.0.1:30002")));
        assert_eq!(map.master_of(16383), Some(&addr("127.0.0.1:30003")));
        assert_eq!(
            map.replicas_of(&addr("127.0.0.1:30002")),
            [addr("127.0.0.1:30005")]
        );
        assert_eq!(map.masters().len(), 3);
        assert_eq!(parse_cluster_slots(&arr(vec![]), "h"), Ok(SlotMap::new()));
    }

    #[test]
    fn cluster_slots_from_a_server_parse() {
        let map = parse_cluster_slots(&whole(SLOTS_IP), "10.0.0.1").unwrap();
        assert!(map.is_complete());
        assert_eq!(
            ranges(&map),
            [
                (0, 8191, "127.0.0.1:17001".into()),
                (8192, 16383, "127.0.0.1:17002".into()),
            ]
        );
        assert_eq!(
            map.replicas_of(&addr("127.0.0.1:17001")),
            [addr("127.0.0.1:17003")]
        );
        assert!(map.replicas_of(&addr("127.0.0.1:17002")).is_empty());
        for raw in [SLOTS_UNKNOWN_ENDPOINT, SLOTS_NO_HOSTNAME] {
            let map = parse_cluster_slots(&whole(raw), "lb.example.com").unwrap();
            assert!(map.is_complete());
            assert_eq!(map.master_of(0), Some(&addr("lb.example.com:17001")));
        }
        let map = parse_cluster_slots(&whole(SLOTS_UNKNOWN_ENDPOINT), "lb").unwrap();
        assert_eq!(map.master_of(9000), Some(&addr("lb:17002")));
        assert_eq!(map.replicas_of(&addr("lb:17001")), [addr("lb:17003")]);
    }

    #[test]
    fn cluster_slots_hosts_default_and_ranges_merge() {
        let reply = arr(vec![
            arr(vec![int(0), int(9), arr(vec![bulk(""), int(7000)])]),
            // Out of order, and the same master again: merged.
            arr(vec![
                int(20),
                int(29),
                arr(vec![Reply::Nil, int(7001)]),
                arr(vec![Reply::Simple(b"?".to_vec()), int(7002)]),
                // A replica without a port is left out.
                arr(vec![bulk("r"), int(0)]),
            ]),
            arr(vec![
                int(10),
                int(19),
                arr(vec![bulk("h"), int(7000)]),
                arr(vec![bulk("h"), int(7000)]),
            ]),
            arr(vec![int(30), int(39), arr(vec![bulk("h"), int(7000)])]),
        ]);
        let map = parse_cluster_slots(&reply, "h").unwrap();
        assert_eq!(
            ranges(&map),
            [
                (0, 19, "h:7000".into()),
                (20, 29, "h:7001".into()),
                (30, 39, "h:7000".into())
            ]
        );
        assert_eq!(map.replicas_of(&addr("h:7001")), [addr("h:7002")]);
        assert!(map.replicas_of(&addr("h:7000")).is_empty());
        assert_eq!(map.covered_slots(), 40);
    }

    #[test]
    fn malformed_cluster_slots_replies_are_errors() {
        let node = || arr(vec![bulk("h"), int(1)]);
        let entry = |s: Reply, e: Reply| arr(vec![s, e, node()]);
        let bad = [
            Reply::Error(b"ERR This instance has cluster support disabled".to_vec()),
            Reply::Nil,
            int(1),
            bulk("x"),
            arr(vec![int(0)]),
            arr(vec![arr(vec![])]),
            arr(vec![arr(vec![int(0), int(1)])]),
            arr(vec![entry(int(5), int(4))]),
            arr(vec![entry(int(0), int(16384))]),
            arr(vec![entry(int(-1), int(1))]),
            arr(vec![entry(int(0), int(i64::MAX))]),
            arr(vec![entry(bulk("zero"), int(1))]),
            arr(vec![entry(Reply::Nil, int(1))]),
            arr(vec![arr(vec![int(0), int(1), int(7)])]),
            arr(vec![arr(vec![int(0), int(1), arr(vec![bulk("h")])])]),
            arr(vec![arr(vec![
                int(0),
                int(1),
                arr(vec![bulk("h"), int(0)]),
            ])]),
            arr(vec![arr(vec![
                int(0),
                int(1),
                arr(vec![bulk("h"), int(65536)]),
            ])]),
            arr(vec![arr(vec![
                int(0),
                int(1),
                arr(vec![bulk("h"), int(-1)]),
            ])]),
            arr(vec![arr(vec![
                int(0),
                int(1),
                arr(vec![bulk("h"), Reply::Nil]),
            ])]),
            arr(vec![arr(vec![int(0), int(1), arr(vec![int(1), int(1)])])]),
            arr(vec![arr(vec![
                int(0),
                int(1),
                arr(vec![Reply::Bulk(vec![0xff, 0xfe]), int(1)]),
            ])]),
            arr(vec![arr(vec![int(0), int(1), node(), bulk("replica")])]),
            arr(vec![arr(vec![int(0), int(1), node(), arr(vec![int(1)])])]),
        ];
        for reply in &bad {
            assert!(parse_cluster_slots(reply, "h").is_err(), "{reply:?}");
        }
        let e = parse_cluster_slots(&bad[0], "h").unwrap_err();
        assert!(e.contains("cluster support disabled"), "{e}");
    }

    #[test]
    fn overlapping_cluster_slots_ranges_are_refused() {
        let node = |p| arr(vec![bulk("h"), int(p)]);
        for (a, b) in [
            ((0, 10), (10, 20)),
            ((0, 10), (0, 10)),
            ((5, 6), (0, 100)),
            ((50, 60), (0, 50)),
        ] {
            let reply = arr(vec![
                arr(vec![int(a.0), int(a.1), node(1)]),
                arr(vec![int(b.0), int(b.1), node(2)]),
            ]);
            let e = parse_cluster_slots(&reply, "h").unwrap_err();
            assert!(e.contains("overlap"), "{e}");
            // Even with one master.
            let reply = arr(vec![
                arr(vec![int(a.0), int(a.1), node(1)]),
                arr(vec![int(b.0), int(b.1), node(1)]),
            ]);
            assert!(parse_cluster_slots(&reply, "h").is_err());
        }
    }

    fn kv(pairs: &[(&str, Reply)]) -> Reply {
        arr(pairs
            .iter()
            .flat_map(|(k, v)| [bulk(k), v.clone()])
            .collect())
    }

    fn shard_node(port: i64, ip: &str, endpoint: &str, role: &str, health: &str) -> Reply {
        kv(&[
            ("id", bulk("e10b7051d6bf2d5febd39a2be297bbaea6084111")),
            ("port", int(port)),
            ("ip", bulk(ip)),
            ("endpoint", bulk(endpoint)),
            ("role", bulk(role)),
            ("replication-offset", int(72156)),
            ("health", bulk(health)),
        ])
    }

    #[test]
    fn cluster_shards_replies_parse() {
        // The shape of the CLUSTER SHARDS documentation's example, with a
        // shard that serves nothing and replicas in every health.
        let reply = arr(vec![
            kv(&[
                ("slots", arr(vec![int(0), int(5460)])),
                (
                    "nodes",
                    arr(vec![
                        shard_node(30001, "127.0.0.1", "127.0.0.1", "master", "online"),
                        shard_node(30004, "127.0.0.1", "127.0.0.1", "replica", "online"),
                        shard_node(30007, "127.0.0.1", "127.0.0.1", "replica", "failed"),
                        shard_node(30008, "127.0.0.1", "127.0.0.1", "replica", "loading"),
                    ]),
                ),
            ]),
            kv(&[
                ("slots", arr(vec![int(5461), int(10922)])),
                (
                    "nodes",
                    arr(vec![
                        // Listed before its master.
                        shard_node(30005, "10.0.0.5", "?", "replica", "online"),
                        shard_node(30002, "10.0.0.2", "", "master", "online"),
                    ]),
                ),
            ]),
            kv(&[
                ("slots", arr(vec![])),
                (
                    "nodes",
                    arr(vec![shard_node(
                        30009,
                        "127.0.0.1",
                        "127.0.0.1",
                        "replica",
                        "online",
                    )]),
                ),
            ]),
            kv(&[
                ("id", bulk("a8f0f5a8c7e2b8d3e5b1a2c3d4e5f60718293a4b")),
                // Slot bounds as decimal strings; two ranges.
                (
                    "slots",
                    arr(vec![
                        bulk("10923"),
                        bulk("16000"),
                        int(16001),
                        bulk("16383"),
                    ]),
                ),
                (
                    "nodes",
                    arr(vec![kv(&[
                        ("port", bulk("30003")),
                        ("tls-port", int(31003)),
                        ("ip", bulk("")),
                        ("endpoint", bulk("")),
                        ("hostname", bulk("host-3.example.com")),
                        ("role", bulk("master")),
                        ("health", bulk("online")),
                        ("some-future-field", arr(vec![int(1)])),
                    ])]),
                ),
            ]),
        ]);
        let map = parse_cluster_shards(&reply, "seed", false).unwrap();
        assert!(map.is_complete());
        assert_eq!(
            ranges(&map),
            [
                (0, 5460, "127.0.0.1:30001".into()),
                (5461, 10922, "10.0.0.2:30002".into()),
                (10923, 16383, "seed:30003".into()),
            ]
        );
        assert_eq!(
            map.replicas_of(&addr("127.0.0.1:30001")),
            [addr("127.0.0.1:30004")]
        );
        assert_eq!(
            map.replicas_of(&addr("10.0.0.2:30002")),
            [addr("10.0.0.5:30005")]
        );
        assert_eq!(map.masters().len(), 3);
        // With TLS: the tls-port where a node has one, else its port.
        let map = parse_cluster_shards(&reply, "seed", true).unwrap();
        assert_eq!(map.master_of(16383), Some(&addr("seed:31003")));
        assert_eq!(map.master_of(0), Some(&addr("127.0.0.1:30001")));
        assert_eq!(
            parse_cluster_shards(&arr(vec![]), "h", false),
            Ok(SlotMap::new())
        );
    }

    #[test]
    fn cluster_shards_from_a_server_parse() {
        let map = parse_cluster_shards(&whole(SHARDS_LOADING), "seed", false).unwrap();
        assert!(map.is_complete());
        assert_eq!(map.master_of(8191), Some(&addr("127.0.0.1:17001")));
        assert_eq!(map.master_of(8192), Some(&addr("127.0.0.1:17002")));
        // The replica is still loading.
        assert!(map.replicas_of(&addr("127.0.0.1:17001")).is_empty());
        // Empty endpoints: the ip.
        let map = parse_cluster_shards(&whole(SHARDS_UNKNOWN_ENDPOINT), "seed", false).unwrap();
        assert_eq!(map.master_of(0), Some(&addr("127.0.0.1:17001")));
        assert_eq!(
            map.replicas_of(&addr("127.0.0.1:17001")),
            [addr("127.0.0.1:17003")]
        );
        // A TLS-only node has no port for a plain connection.
        let tls_only = arr(vec![kv(&[
            ("slots", arr(vec![int(0), int(16383)])),
            (
                "nodes",
                arr(vec![kv(&[
                    ("tls-port", int(6380)),
                    ("endpoint", bulk("h")),
                    ("role", bulk("master")),
                ])]),
            ),
        ])]);
        assert_eq!(
            parse_cluster_shards(&tls_only, "seed", true)
                .unwrap()
                .master_of(0),
            Some(&addr("h:6380"))
        );
        assert!(parse_cluster_shards(&tls_only, "seed", false).is_err());
    }

    #[test]
    fn cluster_shards_pick_the_online_master() {
        let reply = arr(vec![kv(&[
            ("slots", arr(vec![int(0), int(16383)])),
            (
                "nodes",
                arr(vec![
                    shard_node(1, "h", "h", "master", "failed"),
                    shard_node(2, "h", "h", "master", "online"),
                ]),
            ),
        ])]);
        let map = parse_cluster_shards(&reply, "seed", false).unwrap();
        assert_eq!(map.master_of(0), Some(&addr("h:2")));
        assert_eq!(map.masters(), [addr("h:2")]);
        // None online: the first.
        let reply = arr(vec![kv(&[
            ("slots", arr(vec![int(0), int(16383)])),
            (
                "nodes",
                arr(vec![shard_node(1, "h", "h", "master", "failed")]),
            ),
        ])]);
        let map = parse_cluster_shards(&reply, "seed", false).unwrap();
        assert_eq!(map.master_of(0), Some(&addr("h:1")));
    }

    #[test]
    fn malformed_cluster_shards_replies_are_errors() {
        let master = || shard_node(1, "h", "h", "master", "online");
        let shard = |slots: Vec<Reply>, nodes: Vec<Reply>| {
            kv(&[("slots", arr(slots)), ("nodes", arr(nodes))])
        };
        let bad = vec![
            Reply::Error(b"ERR unknown subcommand 'SHARDS'".to_vec()),
            Reply::Nil,
            bulk("x"),
            arr(vec![int(1)]),
            arr(vec![arr(vec![bulk("slots")])]),
            arr(vec![arr(vec![int(1), arr(vec![])])]),
            arr(vec![kv(&[("slots", int(1))])]),
            arr(vec![kv(&[
                ("slots", arr(vec![int(0), int(1)])),
                ("nodes", bulk("n")),
            ])]),
            arr(vec![kv(&[("slots", arr(vec![int(0), int(1)]))])]),
            arr(vec![shard(vec![int(0)], vec![master()])]),
            arr(vec![shard(vec![int(0), int(1), int(2)], vec![master()])]),
            arr(vec![shard(vec![int(1), int(0)], vec![master()])]),
            arr(vec![shard(vec![int(0), int(16384)], vec![master()])]),
            arr(vec![shard(vec![int(-1), int(0)], vec![master()])]),
            arr(vec![shard(vec![int(0), bulk("1x")], vec![master()])]),
            arr(vec![shard(vec![int(0), bulk("")], vec![master()])]),
            arr(vec![shard(vec![int(0), Reply::Nil], vec![master()])]),
            arr(vec![shard(vec![int(0), int(1)], vec![])]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![shard_node(1, "h", "h", "replica", "online")],
            )]),
            arr(vec![shard(vec![int(0), int(1)], vec![bulk("node")])]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![arr(vec![bulk("port")])],
            )]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![arr(vec![int(1), int(1)])],
            )]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![kv(&[("role", bulk("master")), ("ip", bulk("h"))])],
            )]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![kv(&[("role", bulk("master")), ("port", int(70000))])],
            )]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![kv(&[("role", bulk("master")), ("port", bulk("p"))])],
            )]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![kv(&[("role", int(1)), ("port", int(1))])],
            )]),
            arr(vec![shard(
                vec![int(0), int(1)],
                vec![kv(&[
                    ("role", bulk("master")),
                    ("port", int(1)),
                    ("endpoint", Reply::Bulk(vec![0xc3])),
                ])],
            )]),
        ];
        for reply in &bad {
            assert!(
                parse_cluster_shards(reply, "h", false).is_err(),
                "{reply:?}"
            );
        }
        let e = parse_cluster_shards(&bad[0], "h", false).unwrap_err();
        assert!(e.contains("unknown subcommand"), "{e}");
    }

    #[test]
    fn overlapping_cluster_shards_ranges_are_refused() {
        let reply = arr(vec![
            kv(&[
                ("slots", arr(vec![int(0), int(100)])),
                (
                    "nodes",
                    arr(vec![shard_node(1, "h", "h", "master", "online")]),
                ),
            ]),
            kv(&[
                ("slots", arr(vec![int(200), int(300), int(100), int(150)])),
                (
                    "nodes",
                    arr(vec![shard_node(2, "h", "h", "master", "online")]),
                ),
            ]),
        ]);
        let e = parse_cluster_shards(&reply, "h", false).unwrap_err();
        assert!(e.contains("overlap"), "{e}");
        // Within one shard too.
        let reply = arr(vec![kv(&[
            ("slots", arr(vec![int(0), int(100), int(50), int(60)])),
            (
                "nodes",
                arr(vec![shard_node(1, "h", "h", "master", "online")]),
            ),
        ])]);
        assert!(parse_cluster_shards(&reply, "h", false).is_err());
    }

    /// Every reply reachable from `reply` by replacing one element with a
    /// value of another kind, or dropping it.
    fn mutations(reply: &Reply) -> Vec<Reply> {
        let others = [
            Reply::Nil,
            int(-1),
            int(i64::MAX),
            bulk(""),
            bulk("?"),
            Reply::Error(b"ERR".to_vec()),
            arr(vec![]),
        ];
        let mut out: Vec<Reply> = others.to_vec();
        if let Reply::Array(items) = reply {
            for i in 0..items.len() {
                let mut dropped = items.clone();
                dropped.remove(i);
                out.push(arr(dropped));
                for m in mutations(&items[i]) {
                    let mut changed = items.clone();
                    changed[i] = m;
                    out.push(arr(changed));
                }
            }
        }
        out
    }

    #[test]
    fn no_reply_makes_the_parsers_panic() {
        for raw in [SLOTS_IP, SLOTS_UNKNOWN_ENDPOINT, SHARDS_LOADING] {
            let reply = whole(raw);
            let all = mutations(&reply);
            assert!(all.len() > 100);
            for m in &all {
                let _ = parse_cluster_slots(m, "h");
                let _ = parse_cluster_shards(m, "h", false);
                let _ = parse_cluster_shards(m, "h", true);
            }
        }
    }

    #[test]
    fn redirects_parse() {
        assert_eq!(
            parse_redirect(b"MOVED 3999 127.0.0.1:6381", "seed"),
            Some(Redirect::Moved {
                slot: 3999,
                to: addr("127.0.0.1:6381")
            })
        );
        assert_eq!(
            parse_redirect(b"ASK 3999 127.0.0.1:6381", "seed"),
            Some(Redirect::Ask {
                slot: 3999,
                to: addr("127.0.0.1:6381")
            })
        );
        assert_eq!(
            parse_redirect(b"-MOVED 0 host-1.example.com:7000", "seed"),
            Some(Redirect::Moved {
                slot: 0,
                to: addr("host-1.example.com:7000")
            })
        );
        // As Redis 7 writes them with unknown-endpoint and with hostname
        // endpoints but no hostname.
        for line in [&b"MOVED 12182 :17002"[..], b"MOVED 12182 ?:17002"] {
            assert_eq!(
                parse_redirect(line, "lb.example.com"),
                Some(Redirect::Moved {
                    slot: 12182,
                    to: addr("lb.example.com:17002")
                })
            );
        }
        for line in [&b"ASK 16383 ::1:7000"[..], b"ASK 16383 [::1]:7000"] {
            assert_eq!(
                parse_redirect(line, "seed"),
                Some(Redirect::Ask {
                    slot: 16383,
                    to: addr("[::1]:7000")
                })
            );
        }
        for bad in [
            &b""[..],
            b"MOVED",
            b"MOVED 1",
            b"MOVED 1 h",
            b"MOVED 1 h:",
            b"MOVED 1 h:0",
            b"MOVED 1 h:65536",
            b"MOVED 16384 h:1",
            b"MOVED 99999999999 h:1",
            b"MOVED -1 h:1",
            b"MOVED +1 h:1",
            b"MOVED x h:1",
            b"MOVED  1 h:1",
            b"MOVED 1 h:1 extra",
            b"MOVED 1 h:1 ",
            b"moved 1 h:1",
            b"ASKING 1 h:1",
            b"ERR unknown command",
            b"MOVED 1 []:1",
            b"MOVED 1 \xff:1",
        ] {
            assert_eq!(
                parse_redirect(bad, "seed"),
                None,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn cluster_down_and_try_again_are_recognised() {
        assert!(is_cluster_down(b"CLUSTERDOWN The cluster is down"));
        assert!(is_cluster_down(b"-CLUSTERDOWN Hash slot not served"));
        assert!(is_cluster_down(b"CLUSTERDOWN"));
        assert!(!is_cluster_down(b"CLUSTERDOWNS x"));
        assert!(!is_cluster_down(b"ERR CLUSTERDOWN"));
        assert!(!is_cluster_down(
            b"TRYAGAIN Multiple keys request during rehashing of slot"
        ));
        assert!(!is_cluster_down(b""));
        assert!(is_try_again(
            b"TRYAGAIN Multiple keys request during rehashing of slot"
        ));
        assert!(is_try_again(b"-TRYAGAIN"));
        assert!(!is_try_again(b"TRYAGAINX"));
        assert!(!is_try_again(b"CLUSTERDOWN The cluster is down"));
        assert!(!is_try_again(b"MOVED 1 h:1"));
    }
}
