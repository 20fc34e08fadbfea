//! A small XML reader for S3 responses (and STS's AssumeRoleWithWebIdentity
//! answers) and a writer for the one request body kvshard sends.
//!
//! The reader builds an element tree and accepts what S3 and S3-compatible
//! servers produce: an optional `<?xml ...?>` declaration, comments,
//! processing instructions, CDATA, attributes (ignored, including `xmlns`),
//! namespace prefixes (dropped: elements are matched by local name), the five
//! predefined entities and numeric character references. It rejects DOCTYPEs
//! (no entity expansion), unknown entities, characters XML forbids,
//! mismatched or unclosed tags, content after the root, inputs larger than
//! [`MAX_XML_BYTES`] and nesting deeper than [`MAX_XML_DEPTH`]. It never
//! panics on bad input; every failure is an [`XmlError`].
//!
//! Element text is kept exactly (object keys may begin or end with spaces);
//! numbers and booleans are trimmed before parsing. Line ends are normalised
//! to `\n` as XML requires.

use std::fmt;
use std::time::SystemTime;

use crate::credentials::{CredentialSource, Credentials};
use crate::time::parse_rfc3339;

/// Largest response body parsed. A ListObjectsV2 page of 1000 keys of
/// 1024 bytes each is about 1.3 MiB.
pub const MAX_XML_BYTES: usize = 16 << 20;
/// Deepest element nesting accepted (S3 responses are at most 4 deep).
pub const MAX_XML_DEPTH: usize = 32;
/// Largest part number S3 accepts.
pub const MAX_PART_NUMBER: u32 = 10_000;

/// Why a document was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum XmlError {
    /// The input is larger than [`MAX_XML_BYTES`].
    TooLarge(usize),
    /// Elements nest deeper than [`MAX_XML_DEPTH`].
    TooDeep,
    /// Not well-formed.
    Syntax {
        /// Byte offset where the problem was found.
        offset: usize,
        /// What is wrong.
        message: &'static str,
    },
    /// Well-formed, but the root element is not the expected one.
    UnexpectedRoot {
        /// Expected local name.
        expected: &'static str,
        /// Found local name.
        found: String,
    },
    /// A required element is missing.
    Missing {
        /// Path of the element, e.g. `Contents/Size`.
        element: &'static str,
    },
    /// An element that may appear once appears more often.
    Duplicate {
        /// Path of the element.
        element: &'static str,
    },
    /// An element's text is not a valid value.
    InvalidValue {
        /// Path of the element.
        element: &'static str,
        /// The text.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
}

impl fmt::Display for XmlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            XmlError::TooLarge(n) => write!(f, "XML body of {n} bytes exceeds {MAX_XML_BYTES}"),
            XmlError::TooDeep => write!(f, "XML nests deeper than {MAX_XML_DEPTH} elements"),
            XmlError::Syntax { offset, message } => {
                write!(f, "malformed XML at byte {offset}: {message}")
            }
            XmlError::UnexpectedRoot { expected, found } => {
                write!(f, "expected XML root <{expected}>, found <{found}>")
            }
            XmlError::Missing { element } => write!(f, "XML element <{element}> is missing"),
            XmlError::Duplicate { element } => write!(f, "XML element <{element}> appears twice"),
            XmlError::InvalidValue {
                element,
                value,
                expected,
            } => write!(
                f,
                "XML element <{element}> has {value:?}, expected {expected}"
            ),
        }
    }
}

impl std::error::Error for XmlError {}

/// One element: local name, text directly inside it, child elements.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Element {
    name: String,
    text: String,
    children: Vec<Element>,
}

impl Element {
    /// Local name (namespace prefix removed).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The text directly inside this element (all text and CDATA pieces
    /// concatenated, child elements' text excluded).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Child elements in document order.
    pub fn children(&self) -> &[Element] {
        &self.children
    }

    /// Children with local name `name`.
    pub fn children_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Element> + 'a {
        self.children.iter().filter(move |c| c.name == name)
    }

    /// The only child named `name`: `Ok(None)` if absent, an error if
    /// repeated. `path` labels errors.
    fn single<'a>(
        &'a self,
        name: &'a str,
        path: &'static str,
    ) -> Result<Option<&'a Element>, XmlError> {
        let mut found = self.children_named(name);
        let first = found.next();
        if found.next().is_some() {
            return Err(XmlError::Duplicate { element: path });
        }
        Ok(first)
    }

    fn opt_text(&self, name: &str, path: &'static str) -> Result<Option<String>, XmlError> {
        Ok(self.single(name, path)?.map(|e| e.text.clone()))
    }

    fn req_text(&self, name: &str, path: &'static str) -> Result<String, XmlError> {
        self.opt_text(name, path)?
            .ok_or(XmlError::Missing { element: path })
    }

    fn opt_u64(&self, name: &str, path: &'static str) -> Result<Option<u64>, XmlError> {
        match self.single(name, path)? {
            None => Ok(None),
            Some(e) => {
                let t = e.text.trim();
                let ok = !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
                match t.parse::<u64>() {
                    Ok(v) if ok => Ok(Some(v)),
                    _ => Err(XmlError::InvalidValue {
                        element: path,
                        value: e.text.clone(),
                        expected: "an unsigned integer",
                    }),
                }
            }
        }
    }

    fn opt_bool(&self, name: &str, path: &'static str) -> Result<Option<bool>, XmlError> {
        match self.single(name, path)? {
            None => Ok(None),
            Some(e) => match e.text.trim() {
                "true" => Ok(Some(true)),
                "false" => Ok(Some(false)),
                _ => Err(XmlError::InvalidValue {
                    element: path,
                    value: e.text.clone(),
                    expected: "true or false",
                }),
            },
        }
    }

    fn opt_time(&self, name: &str, path: &'static str) -> Result<Option<SystemTime>, XmlError> {
        match self.single(name, path)? {
            None => Ok(None),
            Some(e) => parse_rfc3339(e.text.trim())
                .map(Some)
                .map_err(|_| XmlError::InvalidValue {
                    element: path,
                    value: e.text.clone(),
                    expected: "an ISO 8601 UTC timestamp",
                }),
        }
    }
}

struct Reader<'a> {
    input: &'a str,
    pos: usize,
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':' || !c.is_ascii()
}

fn is_name_char(c: char) -> bool {
    is_name_start(c) || c.is_ascii_digit() || c == '-' || c == '.'
}

/// XML 1.0 `Char`: tab, LF, CR, and everything from U+0020 except
/// surrogates (not representable in `char`), U+FFFE and U+FFFF.
fn is_xml_char(c: char) -> bool {
    matches!(c, '\t' | '\n' | '\r') || (c >= ' ' && c != '\u{FFFE}' && c != '\u{FFFF}')
}

impl<'a> Reader<'a> {
    fn err<T>(&self, message: &'static str) -> Result<T, XmlError> {
        Err(XmlError::Syntax {
            offset: self.pos,
            message,
        })
    }

    fn rest(&self) -> &'a str {
        &self.input[self.pos..]
    }

    fn starts_with(&self, s: &str) -> bool {
        self.rest().starts_with(s)
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn skip_ws(&mut self) {
        let rest = self.rest();
        let trimmed = rest.trim_start_matches([' ', '\t', '\r', '\n']);
        self.pos += rest.len() - trimmed.len();
    }

    /// Skips past `end`, checking that everything skipped is XML text.
    fn skip_past(&mut self, end: &str, message: &'static str) -> Result<&'a str, XmlError> {
        match self.rest().find(end) {
            Some(i) => {
                let body = &self.rest()[..i];
                if !body.chars().all(is_xml_char) {
                    return self.err("forbidden character");
                }
                self.pos += i + end.len();
                Ok(body)
            }
            None => self.err(message),
        }
    }

    /// Comments, processing instructions and whitespace between elements.
    /// Returns an error for a DOCTYPE.
    fn skip_misc(&mut self) -> Result<(), XmlError> {
        loop {
            self.skip_ws();
            if self.starts_with("<!--") {
                self.pos += 4;
                self.skip_past("-->", "unterminated comment")?;
            } else if self.starts_with("<?") {
                self.pos += 2;
                self.skip_past("?>", "unterminated processing instruction")?;
            } else if self.starts_with("<!") {
                return self.err("DOCTYPE and other declarations are not accepted");
            } else {
                return Ok(());
            }
        }
    }

    fn name(&mut self) -> Result<&'a str, XmlError> {
        let rest = self.rest();
        match rest.chars().next() {
            Some(c) if is_name_start(c) => {}
            _ => return self.err("expected a name"),
        }
        let len = rest
            .char_indices()
            .find(|&(_, c)| !is_name_char(c))
            .map_or(rest.len(), |(i, _)| i);
        self.pos += len;
        Ok(&rest[..len])
    }

    /// Decodes `raw` (text or an attribute value) into `out`.
    fn decode_into(&self, raw: &str, start: usize, out: &mut String) -> Result<(), XmlError> {
        let fail = |at: usize, message| {
            Err(XmlError::Syntax {
                offset: start + at,
                message,
            })
        };
        let mut chars = raw.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match c {
                '&' => {
                    let Some(len) = raw[i..].find(';') else {
                        return fail(i, "'&' without ';'");
                    };
                    let entity = &raw[i + 1..i + len];
                    let decoded = match entity {
                        "lt" => '<',
                        "gt" => '>',
                        "amp" => '&',
                        "quot" => '"',
                        "apos" => '\'',
                        _ => {
                            let code = if let Some(hex) = entity
                                .strip_prefix("#x")
                                .or_else(|| entity.strip_prefix("#X"))
                            {
                                (!hex.is_empty()
                                    && hex.len() <= 6
                                    && hex.bytes().all(|b| b.is_ascii_hexdigit()))
                                .then(|| u32::from_str_radix(hex, 16).ok())
                                .flatten()
                            } else if let Some(dec) = entity.strip_prefix('#') {
                                (!dec.is_empty()
                                    && dec.len() <= 7
                                    && dec.bytes().all(|b| b.is_ascii_digit()))
                                .then(|| dec.parse::<u32>().ok())
                                .flatten()
                            } else {
                                return fail(i, "unknown entity");
                            };
                            match code.and_then(char::from_u32) {
                                Some(c) if is_xml_char(c) => c,
                                _ => return fail(i, "invalid character reference"),
                            }
                        }
                    };
                    out.push(decoded);
                    // Skip to the ';'.
                    while let Some(&(j, _)) = chars.peek() {
                        if j > i + len {
                            break;
                        }
                        chars.next();
                    }
                }
                '\r' => {
                    // CR LF and lone CR both become LF.
                    if matches!(chars.peek(), Some(&(_, '\n'))) {
                        chars.next();
                    }
                    out.push('\n');
                }
                c if is_xml_char(c) => out.push(c),
                _ => return fail(i, "forbidden character"),
            }
        }
        Ok(())
    }

    /// Reads an element; `self.pos` is at its `<`.
    fn element(&mut self, depth: usize) -> Result<Element, XmlError> {
        if depth > MAX_XML_DEPTH {
            return Err(XmlError::TooDeep);
        }
        debug_assert!(self.starts_with("<"));
        self.pos += 1;
        let qname = self.name()?;
        let local = qname.rsplit(':').next().unwrap_or(qname);
        if local.is_empty() {
            return self.err("empty local name");
        }
        let mut element = Element {
            name: local.to_owned(),
            ..Element::default()
        };
        // Attributes.
        loop {
            let before = self.pos;
            self.skip_ws();
            if self.starts_with("/>") {
                self.pos += 2;
                return Ok(element);
            }
            if self.starts_with(">") {
                self.pos += 1;
                break;
            }
            if self.pos == before {
                return self.err("expected whitespace, '>' or '/>' in a tag");
            }
            self.name()?;
            self.skip_ws();
            if !self.starts_with("=") {
                return self.err("expected '=' after an attribute name");
            }
            self.pos += 1;
            self.skip_ws();
            let quote = match self.peek() {
                Some(q @ ('"' | '\'')) => q,
                _ => return self.err("expected a quoted attribute value"),
            };
            self.pos += 1;
            let Some(len) = self.rest().find(quote) else {
                return self.err("unterminated attribute value");
            };
            let raw = &self.rest()[..len];
            if raw.contains('<') {
                return self.err("'<' in an attribute value");
            }
            let mut scratch = String::new();
            self.decode_into(raw, self.pos, &mut scratch)?;
            self.pos += len + 1;
        }
        // Content.
        loop {
            if self.rest().is_empty() {
                return self.err("unclosed element (truncated document)");
            }
            if self.starts_with("</") {
                self.pos += 2;
                let close = self.name()?;
                if close != qname {
                    return self.err("closing tag does not match the open element");
                }
                self.skip_ws();
                if !self.starts_with(">") {
                    return self.err("expected '>' to end a closing tag");
                }
                self.pos += 1;
                return Ok(element);
            }
            if self.starts_with("<!--") {
                self.pos += 4;
                self.skip_past("-->", "unterminated comment")?;
            } else if self.starts_with("<![CDATA[") {
                self.pos += 9;
                let body = self.skip_past("]]>", "unterminated CDATA section")?;
                element.text.push_str(body);
            } else if self.starts_with("<?") {
                self.pos += 2;
                self.skip_past("?>", "unterminated processing instruction")?;
            } else if self.starts_with("<!") {
                return self.err("declaration inside an element");
            } else if self.starts_with("<") {
                let child = self.element(depth + 1)?;
                element.children.push(child);
            } else {
                let len = self.rest().find('<').unwrap_or(self.rest().len());
                let raw = &self.rest()[..len];
                let start = self.pos;
                self.decode_into(raw, start, &mut element.text)?;
                self.pos += len;
            }
        }
    }
}

/// Parses a whole document and returns its root element.
pub fn parse(input: &str) -> Result<Element, XmlError> {
    if input.len() > MAX_XML_BYTES {
        return Err(XmlError::TooLarge(input.len()));
    }
    let mut reader = Reader { input, pos: 0 };
    if reader.starts_with("\u{FEFF}") {
        reader.pos += 3;
    }
    reader.skip_misc()?;
    if !reader.starts_with("<") {
        return reader.err("expected the root element");
    }
    let root = reader.element(1)?;
    reader.skip_misc()?;
    if reader.pos != input.len() {
        return reader.err("content after the root element");
    }
    Ok(root)
}

/// Parses bytes (S3 bodies are UTF-8).
pub fn parse_bytes(input: &[u8]) -> Result<Element, XmlError> {
    if input.len() > MAX_XML_BYTES {
        return Err(XmlError::TooLarge(input.len()));
    }
    let text = std::str::from_utf8(input).map_err(|e| XmlError::Syntax {
        offset: e.valid_up_to(),
        message: "not UTF-8",
    })?;
    parse(text)
}

fn root_named(input: &str, expected: &'static str) -> Result<Element, XmlError> {
    let root = parse(input)?;
    if root.name != expected {
        return Err(XmlError::UnexpectedRoot {
            expected,
            found: root.name,
        });
    }
    Ok(root)
}

/// One object of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedObject {
    /// Object key, decoded.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
    /// Last modification time, when the server sends it.
    pub last_modified: Option<SystemTime>,
    /// ETag as sent (with its quotes), when present.
    pub etag: Option<String>,
}

/// A ListObjectsV2 page (`ListBucketResult`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListObjectsV2Page {
    /// Bucket name.
    pub name: Option<String>,
    /// The prefix asked for.
    pub prefix: Option<String>,
    /// Number of keys in this page, as the server reports it.
    pub key_count: Option<u64>,
    /// Page size asked for.
    pub max_keys: Option<u64>,
    /// More pages follow.
    pub is_truncated: bool,
    /// Token to pass as `continuation-token` for the next page; always set
    /// when `is_truncated`.
    pub next_continuation_token: Option<String>,
    /// Objects in this page.
    pub contents: Vec<ListedObject>,
    /// `CommonPrefixes/Prefix` entries (when a delimiter was given).
    pub common_prefixes: Vec<String>,
}

/// Parses a ListObjectsV2 response. A truncated page without a
/// `NextContinuationToken` is rejected (it would end a listing early).
pub fn parse_list_objects_v2(input: &str) -> Result<ListObjectsV2Page, XmlError> {
    let root = root_named(input, "ListBucketResult")?;
    let mut page = ListObjectsV2Page {
        name: root.opt_text("Name", "ListBucketResult/Name")?,
        prefix: root.opt_text("Prefix", "ListBucketResult/Prefix")?,
        key_count: root.opt_u64("KeyCount", "ListBucketResult/KeyCount")?,
        max_keys: root.opt_u64("MaxKeys", "ListBucketResult/MaxKeys")?,
        is_truncated: root
            .opt_bool("IsTruncated", "ListBucketResult/IsTruncated")?
            .unwrap_or(false),
        next_continuation_token: root
            .opt_text(
                "NextContinuationToken",
                "ListBucketResult/NextContinuationToken",
            )?
            .filter(|t| !t.is_empty()),
        ..ListObjectsV2Page::default()
    };
    if page.is_truncated && page.next_continuation_token.is_none() {
        return Err(XmlError::Missing {
            element: "ListBucketResult/NextContinuationToken",
        });
    }
    for contents in root.children_named("Contents") {
        let size = contents
            .opt_u64("Size", "Contents/Size")?
            .ok_or(XmlError::Missing {
                element: "Contents/Size",
            })?;
        page.contents.push(ListedObject {
            key: contents.req_text("Key", "Contents/Key")?,
            size,
            last_modified: contents.opt_time("LastModified", "Contents/LastModified")?,
            etag: contents.opt_text("ETag", "Contents/ETag")?,
        });
    }
    for common in root.children_named("CommonPrefixes") {
        page.common_prefixes
            .push(common.req_text("Prefix", "CommonPrefixes/Prefix")?);
    }
    Ok(page)
}

/// An S3 `<Error>` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3ErrorBody {
    /// Error code, e.g. `NoSuchKey`, `SlowDown`.
    pub code: String,
    /// Human-readable message.
    pub message: Option<String>,
    /// Request id, for support.
    pub request_id: Option<String>,
    /// Extended request id.
    pub host_id: Option<String>,
    /// Key or resource named in the error, when present.
    pub resource: Option<String>,
}

/// Parses an `<Error>` body.
pub fn parse_error(input: &str) -> Result<S3ErrorBody, XmlError> {
    let root = root_named(input, "Error")?;
    let resource = match root.opt_text("Key", "Error/Key")? {
        Some(key) => Some(key),
        None => root.opt_text("Resource", "Error/Resource")?,
    };
    Ok(S3ErrorBody {
        code: root.req_text("Code", "Error/Code")?,
        message: root.opt_text("Message", "Error/Message")?,
        request_id: root.opt_text("RequestId", "Error/RequestId")?,
        host_id: root.opt_text("HostId", "Error/HostId")?,
        resource,
    })
}

/// Parses a `CreateSessionResult` into session credentials (source
/// [`CredentialSource::S3ExpressSession`], expiry from `Expiration`).
pub fn parse_create_session(input: &str) -> Result<Credentials, XmlError> {
    let root = root_named(input, "CreateSessionResult")?;
    let creds = root
        .single("Credentials", "CreateSessionResult/Credentials")?
        .ok_or(XmlError::Missing {
            element: "CreateSessionResult/Credentials",
        })?;
    temporary_credentials(
        creds,
        "CreateSessionResult/Credentials",
        CredentialSource::S3ExpressSession,
    )
}

/// The key id, secret, session token and expiry of a `Credentials` element
/// (CreateSession and STS answer with the same four), as credentials of
/// `source`.
fn temporary_credentials(
    creds: &Element,
    element: &'static str,
    source: CredentialSource,
) -> Result<Credentials, XmlError> {
    let access_key = creds.req_text("AccessKeyId", "Credentials/AccessKeyId")?;
    let secret = creds.req_text("SecretAccessKey", "Credentials/SecretAccessKey")?;
    let token = creds.req_text("SessionToken", "Credentials/SessionToken")?;
    let expiry = creds
        .opt_time("Expiration", "Credentials/Expiration")?
        .ok_or(XmlError::Missing {
            element: "Credentials/Expiration",
        })?;
    Credentials::new(
        access_key.trim(),
        secret.trim(),
        Some(token.trim().to_owned()),
        Some(expiry),
    )
    .map(|c| c.with_source(source))
    .map_err(|_| XmlError::InvalidValue {
        element,
        value: "<redacted>".to_owned(),
        expected: "non-empty key id, secret and token without control characters",
    })
}

/// Parses an STS `AssumeRoleWithWebIdentityResponse` into credentials
/// (source [`CredentialSource::WebIdentity`], expiry from `Expiration`).
pub fn parse_assume_role_with_web_identity(input: &str) -> Result<Credentials, XmlError> {
    let root = root_named(input, "AssumeRoleWithWebIdentityResponse")?;
    let result = root
        .single(
            "AssumeRoleWithWebIdentityResult",
            "AssumeRoleWithWebIdentityResponse/AssumeRoleWithWebIdentityResult",
        )?
        .ok_or(XmlError::Missing {
            element: "AssumeRoleWithWebIdentityResponse/AssumeRoleWithWebIdentityResult",
        })?;
    let creds = result
        .single("Credentials", "AssumeRoleWithWebIdentityResult/Credentials")?
        .ok_or(XmlError::Missing {
            element: "AssumeRoleWithWebIdentityResult/Credentials",
        })?;
    temporary_credentials(
        creds,
        "AssumeRoleWithWebIdentityResult/Credentials",
        CredentialSource::WebIdentity,
    )
}

/// Parses an STS error: `<ErrorResponse><Error><Code>` (the query
/// protocol's form, `RequestId` beside `Error`) or a bare `<Error>`.
pub fn parse_sts_error(input: &str) -> Result<S3ErrorBody, XmlError> {
    let root = parse(input)?;
    let (error, request_id) = match root.name.as_str() {
        "ErrorResponse" => {
            let error = root
                .single("Error", "ErrorResponse/Error")?
                .ok_or(XmlError::Missing {
                    element: "ErrorResponse/Error",
                })?;
            let request_id = match root.opt_text("RequestId", "ErrorResponse/RequestId")? {
                Some(id) => Some(id),
                None => error.opt_text("RequestId", "Error/RequestId")?,
            };
            (error, request_id)
        }
        "Error" => (&root, root.opt_text("RequestId", "Error/RequestId")?),
        _ => {
            return Err(XmlError::UnexpectedRoot {
                expected: "ErrorResponse",
                found: root.name.clone(),
            })
        }
    };
    Ok(S3ErrorBody {
        code: error.req_text("Code", "Error/Code")?,
        message: error.opt_text("Message", "Error/Message")?,
        request_id,
        host_id: None,
        resource: None,
    })
}

/// The answer to CreateMultipartUpload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitiateMultipartUpload {
    /// Bucket, when echoed.
    pub bucket: Option<String>,
    /// Key, when echoed.
    pub key: Option<String>,
    /// Upload id for the part uploads and the completion.
    pub upload_id: String,
}

/// Parses an `InitiateMultipartUploadResult`.
pub fn parse_initiate_multipart_upload(input: &str) -> Result<InitiateMultipartUpload, XmlError> {
    let root = root_named(input, "InitiateMultipartUploadResult")?;
    let upload_id = root.req_text("UploadId", "InitiateMultipartUploadResult/UploadId")?;
    if upload_id.trim().is_empty() {
        return Err(XmlError::InvalidValue {
            element: "InitiateMultipartUploadResult/UploadId",
            value: upload_id,
            expected: "a non-empty upload id",
        });
    }
    Ok(InitiateMultipartUpload {
        bucket: root.opt_text("Bucket", "InitiateMultipartUploadResult/Bucket")?,
        key: root.opt_text("Key", "InitiateMultipartUploadResult/Key")?,
        upload_id,
    })
}

/// One uploaded part for CompleteMultipartUpload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletedPart {
    /// 1..=10000.
    pub part_number: u32,
    /// The part's ETag exactly as UploadPart returned it (quotes included).
    pub etag: String,
}

fn push_escaped(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
}

/// Appends a `CompleteMultipartUpload` body. Parts must be non-empty, with
/// part numbers in 1..=10000 strictly ascending (S3 rejects anything else).
pub fn write_complete_multipart_upload(
    parts: &[CompletedPart],
    out: &mut String,
) -> Result<(), XmlError> {
    if parts.is_empty() {
        return Err(XmlError::Missing {
            element: "CompleteMultipartUpload/Part",
        });
    }
    let mut previous = 0u32;
    for part in parts {
        if part.part_number <= previous || part.part_number > MAX_PART_NUMBER {
            return Err(XmlError::InvalidValue {
                element: "Part/PartNumber",
                value: part.part_number.to_string(),
                expected: "part numbers in 1..=10000, strictly ascending",
            });
        }
        if part.etag.is_empty()
            || !part
                .etag
                .chars()
                .all(|c| c != '\r' && c != '\n' && is_xml_char(c))
        {
            return Err(XmlError::InvalidValue {
                element: "Part/ETag",
                value: part.etag.clone(),
                expected: "a non-empty single-line ETag",
            });
        }
        previous = part.part_number;
    }
    out.push_str(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\
         <CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">",
    );
    for part in parts {
        out.push_str("<Part><PartNumber>");
        out.push_str(&part.part_number.to_string());
        out.push_str("</PartNumber><ETag>");
        push_escaped(out, &part.etag);
        out.push_str("</ETag></Part>");
    }
    out.push_str("</CompleteMultipartUpload>");
    Ok(())
}
