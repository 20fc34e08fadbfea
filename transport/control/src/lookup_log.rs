//! `--lookup-hash-log-*`: one JSONL line per lookup, written to rotating files for
//! offline analysis of prefix reuse.
//!
//! The files are read by the same tooling that reads lmcache 0.5.6's
//! `LookupHashLoggingSubscriber` output, so names and lines match it byte for byte:
//!
//! - file name `lookup_hashes_<YYYYmmdd_HHMMSS>_<count:06>.jsonl`, the time being the
//!   rotation moment in UTC (0.5.6 formats `datetime.fromtimestamp(ts, tz=timezone.utc)`),
//!   `count` a running index that starts at the number of files already in the directory;
//! - line `{"timestamp": 1711929600.123, "request_id": "r", "model_name": "m",
//!   "chunk_size": 256, "seq_len": 1024, "dtypes": ["torch.float16"], "shapes": [[2, 16]],
//!   "chunk_hashes": ["0x<64 hex>", ...]}` as Python's `json.dumps` writes it (`", "` and
//!   `": "` separators, `ensure_ascii`, `repr` floats).
//!
//! A file rotates before a line is written when the interval has elapsed since it was
//! opened or it has reached the size limit (so a file may exceed the limit by one line).
//! At most `max_files` matching files are kept; the oldest (by modification time for
//! files of earlier runs, by creation order for ours) are deleted.
//!
//! In the server the log belongs to a writer thread ([`LookupLogWriter`]): the front
//! queues a [`LookupRecord`] per lookup on a bounded channel and never waits for it;
//! a record that finds the channel full is dropped and the front counts it.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use kvshard_io::json_text::{push_string, NonAscii};
use kvshard_messages::config::LookupHashLogSettings;

const FILE_PREFIX: &str = "lookup_hashes_";
const FILE_SUFFIX: &str = ".jsonl";

struct OpenFile {
    path: PathBuf,
    writer: BufWriter<File>,
    /// Unix seconds of the rotation that opened it.
    opened_at: f64,
    /// Bytes written so far (the file is created empty).
    size: u64,
}

/// The rotating lookup-hash log. Owned by one thread (the writer); not shared.
pub struct LookupHashLog {
    settings: LookupHashLogSettings,
    current: Option<OpenFile>,
    /// Every kept file, oldest first, including the current one.
    files: VecDeque<PathBuf>,
    /// Index for the next file name.
    file_count: u64,
    /// Set after an I/O error: logging stops, lookups go on.
    disabled: bool,
    line: String,
    /// `torch.<dtype>` of the record being written.
    dtype: String,
}

impl LookupHashLog {
    /// Creates the directory and takes stock of the log files already there, so that
    /// `max_files` counts files from earlier runs too. No file is opened until the
    /// first line.
    pub fn open(settings: &LookupHashLogSettings) -> io::Result<Self> {
        fs::create_dir_all(&settings.dir).map_err(|e| with_path(e, "create", &settings.dir))?;
        let files = existing_files(&settings.dir)?;
        // The first line may come hours later: find out now whether files can
        // be created here (a read-only mount, a full disk of inodes).
        let probe = settings
            .dir
            .join(format!(".kvshard-write-probe.{}", std::process::id()));
        fs::write(&probe, b"")
            .and_then(|()| fs::remove_file(&probe))
            .map_err(|e| with_path(e, "write a file in", &settings.dir))?;
        log::info!(
            "lookup hash log: dir={} rotation_interval={}s rotation_max_bytes={} max_files={} existing_files={}",
            settings.dir.display(),
            settings.rotation_interval.as_secs_f64(),
            settings.rotation_max_bytes,
            settings.max_files,
            files.len()
        );
        Ok(LookupHashLog {
            settings: settings.clone(),
            current: None,
            file_count: files.len() as u64,
            files: files.into(),
            disabled: false,
            line: String::with_capacity(4096),
            dtype: String::new(),
        })
    }

    /// False once an I/O error has switched logging off.
    pub fn is_enabled(&self) -> bool {
        !self.disabled
    }

    /// Writes one line for a lookup and flushes it.
    ///
    /// On an I/O error, logging is disabled (one error log line) and the error is
    /// returned once, for information only: a lookup must never fail because of this
    /// log, so callers ignore the result. Later calls are no-ops returning `Ok`.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &mut self,
        now: SystemTime,
        request_id: &str,
        model_name: &str,
        chunk_size: usize,
        seq_len: usize,
        dtypes: &[String],
        shapes: &[Vec<u64>],
        chunk_hashes: &[[u8; 32]],
    ) -> io::Result<()> {
        self.append(
            now,
            request_id,
            model_name,
            chunk_size,
            seq_len,
            dtypes,
            shapes,
            chunk_hashes,
            true,
        )
    }

    /// Writes the line of a queued lookup, leaving it in the file's buffer until
    /// [`LookupHashLog::flush`] (or a rotation). Errors as [`LookupHashLog::record`].
    pub fn write_record(&mut self, rec: &LookupRecord) -> io::Result<()> {
        let mut dtype = std::mem::take(&mut self.dtype);
        dtype.clear();
        dtype.push_str("torch.");
        dtype.push_str(&rec.dtype);
        let result = self.append(
            rec.at,
            &rec.request_id,
            &rec.model_name,
            rec.chunk_size,
            rec.seq_len,
            std::slice::from_ref(&dtype),
            std::slice::from_ref(&rec.shape),
            &rec.chunk_hashes,
            false,
        );
        self.dtype = dtype;
        result
    }

    /// Flushes the current file. Errors as [`LookupHashLog::record`].
    pub fn flush(&mut self) -> io::Result<()> {
        if self.disabled {
            return Ok(());
        }
        let Some(file) = self.current.as_mut() else {
            return Ok(());
        };
        let result = file
            .writer
            .flush()
            .map_err(|e| with_path(e, "flush", &file.path));
        result.map_err(|e| self.disable(e))
    }

    #[allow(clippy::too_many_arguments)]
    fn append(
        &mut self,
        now: SystemTime,
        request_id: &str,
        model_name: &str,
        chunk_size: usize,
        seq_len: usize,
        dtypes: &[String],
        shapes: &[Vec<u64>],
        chunk_hashes: &[[u8; 32]],
        flush: bool,
    ) -> io::Result<()> {
        if self.disabled {
            return Ok(());
        }
        let ts = unix_seconds(now);
        let mut line = std::mem::take(&mut self.line);
        line.clear();
        format_line(
            &mut line,
            ts,
            request_id,
            model_name,
            chunk_size,
            seq_len,
            dtypes,
            shapes,
            chunk_hashes,
        );
        let result = self.write_line(ts, &line, flush);
        self.line = line;
        result.map_err(|e| self.disable(e))
    }

    /// Switches logging off after an I/O error (one error line); gives the error back.
    fn disable(&mut self, e: io::Error) -> io::Error {
        self.disabled = true;
        self.current = None;
        log::error!("lookup hash log disabled after an I/O error: {e}");
        e
    }

    fn write_line(&mut self, ts: f64, line: &str, flush: bool) -> io::Result<()> {
        if self.needs_rotation(ts) {
            self.rotate(ts)?;
        }
        let file = self.current.as_mut().expect("rotate leaves a file open");
        file.writer
            .write_all(line.as_bytes())
            .and_then(|()| if flush { file.writer.flush() } else { Ok(()) })
            .map_err(|e| with_path(e, "write", &file.path))?;
        file.size += line.len() as u64;
        Ok(())
    }

    fn needs_rotation(&self, ts: f64) -> bool {
        match &self.current {
            None => true,
            Some(f) => {
                ts - f.opened_at >= self.settings.rotation_interval.as_secs_f64()
                    || f.size >= self.settings.rotation_max_bytes
            }
        }
    }

    fn rotate(&mut self, ts: f64) -> io::Result<()> {
        if let Some(mut old) = self.current.take() {
            old.writer
                .flush()
                .map_err(|e| with_path(e, "flush", &old.path))?;
        }
        let name = file_name(ts, self.file_count);
        let path = self.settings.dir.join(name);
        let file = File::create(&path).map_err(|e| with_path(e, "create", &path))?;
        self.file_count += 1;
        self.files.push_back(path.clone());
        self.current = Some(OpenFile {
            path,
            writer: BufWriter::new(file),
            opened_at: ts,
            size: 0,
        });
        // The file being written is never pruned, even with max_files 0 (0.5.6 would
        // unlink it and keep writing into the void).
        while self.files.len() > self.settings.max_files.max(1) {
            let oldest = self.files.pop_front().expect("len > 1");
            match fs::remove_file(&oldest) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                // Losing the prune is not worth losing the log over, as in 0.5.6.
                Err(e) => log::error!(
                    "failed to delete old lookup hash file {}: {e}",
                    oldest.display()
                ),
            }
        }
        Ok(())
    }
}

/// One lookup's line, as the front queues it for the writer thread.
#[derive(Debug, Clone, PartialEq)]
pub struct LookupRecord {
    /// When the lookup arrived (the line's `timestamp`).
    pub at: SystemTime,
    pub request_id: String,
    pub model_name: String,
    pub chunk_size: usize,
    /// Tokens in the request.
    pub seq_len: usize,
    /// The layout's dtype name without `torch.` (the line says `torch.<dtype>`).
    pub dtype: String,
    pub shape: Vec<u64>,
    pub chunk_hashes: Vec<[u8; 32]>,
}

/// Records the writer thread's channel holds.
pub const WRITER_QUEUE_RECORDS: usize = 4096;

/// Records the writer thread writes between two flushes when more are queued.
const WRITER_BATCH: usize = 256;

/// What became of a record handed to [`LookupLogWriter::send`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendOutcome {
    Queued,
    /// The channel was full: the record was dropped.
    Full,
    /// The writer has stopped (an I/O error disabled the log): the record was dropped.
    Closed,
}

/// The front's end of the lookup-hash log: a bounded channel to the thread that
/// owns the [`LookupHashLog`] and does the formatting, writing, rotation and pruning.
/// Dropping it closes the channel and joins the thread once it has written and
/// flushed every queued record.
pub struct LookupLogWriter {
    tx: Option<SyncSender<LookupRecord>>,
    thread: Option<JoinHandle<()>>,
}

impl LookupLogWriter {
    /// Starts the writer thread with a channel of `capacity` records.
    pub fn start(log: LookupHashLog, capacity: usize) -> io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel(capacity);
        let mut writer = LookupLogWriter::queue_only(tx);
        writer.run(log, rx)?;
        Ok(writer)
    }

    fn queue_only(tx: SyncSender<LookupRecord>) -> Self {
        LookupLogWriter {
            tx: Some(tx),
            thread: None,
        }
    }

    fn run(&mut self, log: LookupHashLog, rx: Receiver<LookupRecord>) -> io::Result<()> {
        let thread = std::thread::Builder::new()
            .name("kvshard-lookup-log".into())
            .spawn(move || write_records(log, rx))?;
        self.thread = Some(thread);
        Ok(())
    }

    /// Queues `rec` without waiting: a full channel drops it.
    pub fn send(&self, rec: LookupRecord) -> SendOutcome {
        let Some(tx) = &self.tx else {
            return SendOutcome::Closed;
        };
        match tx.try_send(rec) {
            Ok(()) => SendOutcome::Queued,
            Err(TrySendError::Full(_)) => SendOutcome::Full,
            Err(TrySendError::Disconnected(_)) => SendOutcome::Closed,
        }
    }

    /// Closes the channel and waits for the writer to write and flush what was queued.
    pub fn finish(&mut self) {
        drop(self.tx.take());
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                log::error!("the lookup hash log writer thread panicked");
            }
        }
    }
}

impl Drop for LookupLogWriter {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The writer thread: writes records in queue order, flushing whenever the queue
/// runs dry (or after [`WRITER_BATCH`] records), until the channel closes and is
/// empty or an I/O error disables the log.
fn write_records(mut log: LookupHashLog, rx: Receiver<LookupRecord>) {
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        let mut written = 0;
        while let Some(rec) = next.take() {
            // An error disables the log; it has said so.
            let _ = log.write_record(&rec);
            written += 1;
            if written < WRITER_BATCH {
                next = rx.try_recv().ok();
            }
        }
        let _ = log.flush();
        if !log.is_enabled() {
            return;
        }
    }
}

fn with_path(e: io::Error, op: &str, path: &Path) -> io::Error {
    io::Error::new(
        e.kind(),
        format!("lookup hash log: {op} {}: {e}", path.display()),
    )
}

/// Files matching `lookup_hashes_*.jsonl`, oldest modification first.
fn existing_files(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| with_path(e, "list", dir))? {
        let entry = entry.map_err(|e| with_path(e, "list", dir))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with(FILE_PREFIX)
            && name.ends_with(FILE_SUFFIX)
            && name.len() >= FILE_PREFIX.len() + FILE_SUFFIX.len())
        {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let mtime = meta.modified().unwrap_or(UNIX_EPOCH);
        found.push((mtime, entry.path()));
    }
    found.sort();
    Ok(found.into_iter().map(|(_, p)| p).collect())
}

/// `time.time()` of `now`: float seconds since the epoch (negative before it).
fn unix_seconds(now: SystemTime) -> f64 {
    match now.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_secs_f64(),
        Err(e) => -e.duration().as_secs_f64(),
    }
}

fn file_name(ts: f64, count: u64) -> String {
    let (y, mo, d, h, mi, s) = utc_fields(ts.floor() as i64);
    format!("{FILE_PREFIX}{y:04}{mo:02}{d:02}_{h:02}{mi:02}{s:02}_{count:06}{FILE_SUFFIX}")
}

/// UTC calendar fields of a unix second (proleptic Gregorian, days-from-civil inverse).
fn utc_fields(secs: i64) -> (i64, u32, u32, u32, u32, u32) {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (
        year,
        month,
        day,
        (sod / 3600) as u32,
        (sod % 3600 / 60) as u32,
        (sod % 60) as u32,
    )
}

#[allow(clippy::too_many_arguments)]
fn format_line(
    out: &mut String,
    ts: f64,
    request_id: &str,
    model_name: &str,
    chunk_size: usize,
    seq_len: usize,
    dtypes: &[String],
    shapes: &[Vec<u64>],
    chunk_hashes: &[[u8; 32]],
) {
    out.push_str("{\"timestamp\": ");
    push_py_float(out, ts);
    out.push_str(", \"request_id\": ");
    push_py_str(out, request_id);
    out.push_str(", \"model_name\": ");
    push_py_str(out, model_name);
    let _ = write!(
        out,
        ", \"chunk_size\": {chunk_size}, \"seq_len\": {seq_len}, \"dtypes\": ["
    );
    for (i, d) in dtypes.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_py_str(out, d);
    }
    out.push_str("], \"shapes\": [");
    for (i, shape) in shapes.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push('[');
        for (j, dim) in shape.iter().enumerate() {
            if j > 0 {
                out.push_str(", ");
            }
            let _ = write!(out, "{dim}");
        }
        out.push(']');
    }
    out.push_str("], \"chunk_hashes\": [");
    for (i, h) in chunk_hashes.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str("\"0x");
        for b in h {
            let _ = write!(out, "{b:02x}");
        }
        out.push('"');
    }
    out.push_str("]}\n");
}

/// A JSON string as Python's `json.dumps` writes it with `ensure_ascii=True`.
fn push_py_str(out: &mut String, s: &str) {
    push_string(out, s, NonAscii::Escape);
}

/// A float as Python's `repr` (and so `json.dumps`) writes it: the shortest digits that
/// round-trip, positional for decimal exponents -4..=15, otherwise `d.ddde+XX`.
fn push_py_float(out: &mut String, x: f64) {
    if x.is_nan() {
        out.push_str("NaN");
        return;
    }
    if x.is_infinite() {
        out.push_str(if x > 0.0 { "Infinity" } else { "-Infinity" });
        return;
    }
    // `{:e}` gives the shortest round-trip digits: "-1.234e9", "5e-7", "0e0".
    let sci = format!("{:e}", x.abs());
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if x.is_sign_negative() {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                for _ in digits.len()..int_len {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let _ = write!(out, "e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!(
                "kvshard-lookup-log-{tag}-{}-{n}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&p);
            TempDir(p)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn settings(
        dir: &Path,
        interval_s: u64,
        max_bytes: u64,
        max_files: usize,
    ) -> LookupHashLogSettings {
        LookupHashLogSettings {
            dir: dir.to_path_buf(),
            rotation_interval: Duration::from_secs(interval_s),
            rotation_max_bytes: max_bytes,
            max_files,
        }
    }

    fn log_files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with(FILE_PREFIX) && n.ends_with(FILE_SUFFIX))
            .collect();
        names.sort();
        names
    }

    fn at(secs: f64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs_f64(secs)
    }

    fn record_simple(log: &mut LookupHashLog, secs: f64, id: &str) {
        log.record(
            at(secs),
            id,
            "m",
            256,
            512,
            &["torch.float16".to_string()],
            &[vec![2, 16]],
            &[[0xab; 32]],
        )
        .unwrap();
    }

    #[test]
    fn line_matches_python_json_dumps() {
        let dir = TempDir::new("line");
        let mut log = LookupHashLog::open(&settings(&dir.0, 3600, 1 << 20, 10)).unwrap();
        let mut h1 = [0u8; 32];
        h1[0] = 0x01;
        h1[31] = 0xff;
        log.record(
            at(1_711_929_600.5),
            "req-\"é\"",
            "DeepSeek-V3",
            256,
            1024,
            &[
                "torch.float8_e4m3fn".to_string(),
                "torch.bfloat16".to_string(),
            ],
            &[vec![32, 256, 128], vec![2, 4]],
            &[h1, [0x10; 32]],
        )
        .unwrap();
        let names = log_files(&dir.0);
        // 1711929600 is 2024-04-01 00:00:00 UTC.
        assert_eq!(
            names,
            vec!["lookup_hashes_20240401_000000_000000.jsonl".to_string()]
        );
        let text = fs::read_to_string(dir.0.join(&names[0])).unwrap();
        let h1_hex = format!("0x01{}ff", "00".repeat(30));
        let h2_hex = format!("0x{}", "10".repeat(32));
        let expected = format!(
            "{{\"timestamp\": 1711929600.5, \"request_id\": \"req-\\\"\\u00e9\\\"\", \"model_name\": \"DeepSeek-V3\", \
             \"chunk_size\": 256, \"seq_len\": 1024, \"dtypes\": [\"torch.float8_e4m3fn\", \"torch.bfloat16\"], \
             \"shapes\": [[32, 256, 128], [2, 4]], \"chunk_hashes\": [\"{h1_hex}\", \"{h2_hex}\"]}}\n"
        );
        assert_eq!(text, expected);
        let v: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
        assert_eq!(v["timestamp"], 1_711_929_600.5);
        assert_eq!(v["request_id"], "req-\"é\"");
        assert_eq!(v["shapes"][0][2], 128);
        assert_eq!(v["chunk_hashes"][0], h1_hex.as_str());
        assert_eq!(v["chunk_hashes"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn empty_lists_and_line_per_record() {
        let dir = TempDir::new("empty");
        let mut log = LookupHashLog::open(&settings(&dir.0, 3600, 1 << 20, 10)).unwrap();
        log.record(at(1_700_000_000.0), "a", "m", 16, 0, &[], &[], &[])
            .unwrap();
        record_simple(&mut log, 1_700_000_001.25, "b");
        let names = log_files(&dir.0);
        assert_eq!(names.len(), 1);
        let text = fs::read_to_string(dir.0.join(&names[0])).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(
            lines[0],
            "{\"timestamp\": 1700000000.0, \"request_id\": \"a\", \"model_name\": \"m\", \"chunk_size\": 16, \
             \"seq_len\": 0, \"dtypes\": [], \"shapes\": [], \"chunk_hashes\": []}"
        );
        let v: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
        assert_eq!(v["request_id"], "b");
        assert_eq!(v["timestamp"], 1_700_000_001.25);
    }

    #[test]
    fn rotates_by_size_and_by_interval() {
        let dir = TempDir::new("rotate");
        // Each line is ~250 bytes: a 300-byte limit lets one line per file after the first fills it.
        let mut log = LookupHashLog::open(&settings(&dir.0, 100, 300, 100)).unwrap();
        record_simple(&mut log, 1_000.0, "r0");
        assert_eq!(log_files(&dir.0).len(), 1);
        record_simple(&mut log, 1_001.0, "r1"); // under 300 bytes before it: same file
        assert_eq!(log_files(&dir.0).len(), 1);
        record_simple(&mut log, 1_002.0, "r2"); // over the limit now: rotates
        assert_eq!(log_files(&dir.0).len(), 2);
        record_simple(&mut log, 1_102.0, "r3"); // 100 s after the file opened: rotates
        let names = log_files(&dir.0);
        assert_eq!(
            names,
            vec![
                "lookup_hashes_19700101_001640_000000.jsonl",
                "lookup_hashes_19700101_001642_000001.jsonl",
                "lookup_hashes_19700101_001822_000002.jsonl",
            ]
        );
        let first = fs::read_to_string(dir.0.join(&names[0])).unwrap();
        assert_eq!(first.lines().count(), 2);
        assert!(first.len() > 300);
    }

    #[test]
    fn prunes_to_max_files_counting_earlier_runs() {
        let dir = TempDir::new("prune");
        fs::create_dir_all(&dir.0).unwrap();
        // Two files from an "earlier run" and one unrelated file that must survive.
        fs::write(
            dir.0.join("lookup_hashes_20200101_000000_000000.jsonl"),
            "old0\n",
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        fs::write(
            dir.0.join("lookup_hashes_20200101_000001_000001.jsonl"),
            "old1\n",
        )
        .unwrap();
        fs::write(dir.0.join("notes.txt"), "keep").unwrap();
        let mut log = LookupHashLog::open(&settings(&dir.0, 1, 1 << 20, 3)).unwrap();
        record_simple(&mut log, 10.0, "a"); // 3 files: nothing pruned
        assert_eq!(log_files(&dir.0).len(), 3);
        record_simple(&mut log, 11.0, "b"); // interval of 1 s elapsed: 4th file, the oldest goes
        let names = log_files(&dir.0);
        assert_eq!(
            names,
            vec![
                "lookup_hashes_19700101_000010_000002.jsonl",
                "lookup_hashes_19700101_000011_000003.jsonl",
                "lookup_hashes_20200101_000001_000001.jsonl",
            ]
        );
        record_simple(&mut log, 12.0, "c");
        assert!(!dir
            .0
            .join("lookup_hashes_20200101_000001_000001.jsonl")
            .exists());
        assert_eq!(log_files(&dir.0).len(), 3);
        assert!(dir.0.join("notes.txt").exists());
    }

    #[test]
    fn max_files_zero_keeps_the_current_file() {
        let dir = TempDir::new("zero");
        let mut log = LookupHashLog::open(&settings(&dir.0, 1, 1 << 20, 0)).unwrap();
        record_simple(&mut log, 10.0, "a");
        record_simple(&mut log, 20.0, "b");
        let names = log_files(&dir.0);
        assert_eq!(names, vec!["lookup_hashes_19700101_000020_000001.jsonl"]);
        assert!(fs::read_to_string(dir.0.join(&names[0]))
            .unwrap()
            .contains("\"b\""));
    }

    #[test]
    fn io_error_disables_logging_once() {
        let dir = TempDir::new("err");
        let mut log = LookupHashLog::open(&settings(&dir.0, 1, 1 << 20, 10)).unwrap();
        record_simple(&mut log, 10.0, "a");
        // Removing the directory makes the next rotation's create fail.
        fs::remove_dir_all(&dir.0).unwrap();
        let err = log.record(at(20.0), "b", "m", 1, 1, &[], &[], &[]);
        assert!(err.is_err());
        assert!(!log.is_enabled());
        fs::create_dir_all(&dir.0).unwrap();
        assert!(log.record(at(30.0), "c", "m", 1, 1, &[], &[], &[]).is_ok());
        assert!(log_files(&dir.0).is_empty());
    }

    fn queued(i: usize, secs: f64) -> LookupRecord {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&(i as u64).to_be_bytes());
        LookupRecord {
            at: at(secs),
            request_id: format!("req-{i}"),
            model_name: "m".into(),
            chunk_size: 256,
            seq_len: 256 * (i % 5),
            dtype: "bfloat16".into(),
            shape: vec![2, 16, i as u64],
            chunk_hashes: vec![h; i % 5],
        }
    }

    /// Every log file of `dir`, concatenated in name order.
    fn all_lines(dir: &Path) -> String {
        log_files(dir)
            .iter()
            .map(|n| fs::read_to_string(dir.join(n)).unwrap())
            .collect()
    }

    #[test]
    fn writer_thread_writes_what_record_writes_in_order() {
        let (direct, threaded) = (TempDir::new("direct"), TempDir::new("threaded"));
        // Small files: the writer rotates (and prunes) as the direct log does.
        let recs: Vec<LookupRecord> = (0..500)
            .map(|i| queued(i, 1_000.0 + i as f64 * 0.25))
            .collect();
        let mut log = LookupHashLog::open(&settings(&direct.0, 30, 4096, 20)).unwrap();
        for r in &recs {
            log.record(
                r.at,
                &r.request_id,
                &r.model_name,
                r.chunk_size,
                r.seq_len,
                &[format!("torch.{}", r.dtype)],
                std::slice::from_ref(&r.shape),
                &r.chunk_hashes,
            )
            .unwrap();
        }
        let log = LookupHashLog::open(&settings(&threaded.0, 30, 4096, 20)).unwrap();
        let writer = LookupLogWriter::start(log, recs.len()).unwrap();
        for r in &recs {
            assert_eq!(writer.send(r.clone()), SendOutcome::Queued);
        }
        // Dropping it drains the channel and joins the thread.
        drop(writer);
        assert_eq!(log_files(&threaded.0), log_files(&direct.0));
        assert_eq!(log_files(&threaded.0).len(), 20);
        let text = all_lines(&threaded.0);
        assert_eq!(text, all_lines(&direct.0));
        let ids: Vec<String> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["request_id"].to_string()
            })
            .collect();
        let first = recs.len() - ids.len();
        let want: Vec<String> = (first..recs.len())
            .map(|i| format!("\"req-{i}\""))
            .collect();
        assert_eq!(ids, want);
    }

    #[test]
    fn full_channel_drops_records() {
        let dir = TempDir::new("full");
        let (tx, rx) = mpsc::sync_channel(3);
        let mut writer = LookupLogWriter::queue_only(tx);
        // No thread reads yet: the fourth and fifth find the channel full.
        let outcomes: Vec<SendOutcome> = (0..5).map(|i| writer.send(queued(i, 10.0))).collect();
        assert_eq!(
            outcomes,
            [
                SendOutcome::Queued,
                SendOutcome::Queued,
                SendOutcome::Queued,
                SendOutcome::Full,
                SendOutcome::Full
            ]
        );
        let dropped = outcomes.iter().filter(|o| **o == SendOutcome::Full).count();
        assert_eq!(dropped, 2);
        let log = LookupHashLog::open(&settings(&dir.0, 3600, 1 << 20, 10)).unwrap();
        writer.run(log, rx).unwrap();
        writer.finish();
        assert_eq!(writer.send(queued(9, 11.0)), SendOutcome::Closed);
        let text = all_lines(&dir.0);
        let ids: Vec<&str> = text
            .lines()
            .map(|l| {
                l.split("\"request_id\": \"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
            })
            .collect();
        assert_eq!(ids, ["req-0", "req-1", "req-2"]);
        assert!(text.contains("\"dtypes\": [\"torch.bfloat16\"], \"shapes\": [[2, 16, 0]]"));
    }

    #[test]
    fn writer_stops_after_an_io_error() {
        let dir = TempDir::new("writer-err");
        let log = LookupHashLog::open(&settings(&dir.0, 3600, 1 << 20, 10)).unwrap();
        // The first rotation's create fails: the log disables and the thread ends.
        fs::remove_dir_all(&dir.0).unwrap();
        let writer = LookupLogWriter::start(log, 16).unwrap();
        assert_eq!(writer.send(queued(0, 10.0)), SendOutcome::Queued);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while writer.send(queued(1, 11.0)) != SendOutcome::Closed {
            assert!(
                std::time::Instant::now() < deadline,
                "the writer did not stop"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(writer);
        assert!(!dir.0.exists());
    }

    #[test]
    fn python_float_repr() {
        let cases: &[(f64, &str)] = &[
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (1.5, "1.5"),
            (1_711_929_600.123_456_7, "1711929600.1234567"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.25e100, "1.25e+100"),
            (-2.5e-7, "-2.5e-07"),
            (123.0, "123.0"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (x, want) in cases {
            let mut s = String::new();
            push_py_float(&mut s, *x);
            assert_eq!(&s, want, "repr of {x}");
        }
    }

    #[test]
    fn python_ascii_strings() {
        let mut s = String::new();
        push_py_str(&mut s, "a\\b\n\t\u{1}\u{7f}é😀");
        assert_eq!(s, "\"a\\\\b\\n\\t\\u0001\\u007f\\u00e9\\ud83d\\ude00\"");
    }

    #[test]
    fn utc_calendar() {
        assert_eq!(utc_fields(0), (1970, 1, 1, 0, 0, 0));
        assert_eq!(utc_fields(951_782_400), (2000, 2, 29, 0, 0, 0));
        assert_eq!(utc_fields(1_775_053_825), (2026, 4, 1, 14, 30, 25));
        assert_eq!(utc_fields(-1), (1969, 12, 31, 23, 59, 59));
    }
}
