//! Pinning host memory (the shard slabs) for DMA.
//!
//! A region is registered in bounded pieces (64 MiB by default, as lmcache
//! 0.5.6's lazy allocator pins its L1), so registration can be spread out
//! and a failure is local. Each piece is its own registration, and one copy
//! that spans two registrations fails with `CUDA_ERROR_INVALID_VALUE`, so
//! every copy to or from a region is cut at piece boundaries with
//! [`split_copy`]. The planner and splitter are pure and tested without a
//! GPU; [`PinnedRegion`] does the registering.

use std::ffi::{c_uint, c_void};
use std::fmt;

use cudarc::driver::sys;

use super::{driver_call, driver_call_in_drop, Device, DeviceError};

/// Default piece size: lmcache 0.5.6's `PIN_CHUNK_SIZE`.
pub const DEFAULT_PIECE_BYTES: u64 = 64 << 20;

/// Host page size the piece size and region base must be multiples of, so
/// no page belongs to two registrations.
pub const HOST_PAGE_BYTES: u64 = 4096;

/// Bound on the pieces of one region (64 TiB at the default piece size).
pub const MAX_PIECES: u64 = 1 << 20;

/// One registration: `[offset, offset + len)` relative to the region base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub offset: u64,
    pub len: u64,
}

impl Piece {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// One part of a copy that stays inside a single piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyPart {
    /// Index of the piece it lies in.
    pub piece: usize,
    /// Offset relative to the region base.
    pub offset: u64,
    pub len: u64,
}

/// Why a region or a copy cannot be planned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanError {
    ZeroLength,
    BadPieceSize {
        piece_bytes: u64,
    },
    MisalignedBase {
        base_addr: u64,
    },
    AddressOverflow {
        base_addr: u64,
        len: u64,
    },
    TooManyPieces {
        pieces: u64,
        max: u64,
    },
    NoPieces,
    CopyOutOfRange {
        offset: u64,
        len: u64,
        region_len: u64,
    },
}

impl fmt::Display for PlanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroLength => write!(f, "cannot pin a zero-length region"),
            Self::BadPieceSize { piece_bytes } => write!(
                f,
                "piece size {piece_bytes} must be a non-zero multiple of {HOST_PAGE_BYTES}"
            ),
            Self::MisalignedBase { base_addr } => write!(
                f,
                "region base {base_addr:#x} is not aligned to {HOST_PAGE_BYTES} bytes"
            ),
            Self::AddressOverflow { base_addr, len } => {
                write!(
                    f,
                    "region {base_addr:#x} + {len} overflows the address space"
                )
            }
            Self::TooManyPieces { pieces, max } => {
                write!(
                    f,
                    "{pieces} pieces exceed the limit of {max}; use larger pieces"
                )
            }
            Self::NoPieces => write!(f, "no pieces given"),
            Self::CopyOutOfRange {
                offset,
                len,
                region_len,
            } => write!(
                f,
                "copy at offset {offset} of {len} bytes is outside the {region_len} byte region"
            ),
        }
    }
}

impl std::error::Error for PlanError {}

/// Cuts `[base_addr, base_addr + len)` into pieces of `piece_bytes` (the
/// last may be shorter), offsets relative to `base_addr`.
pub fn plan_pieces(base_addr: u64, len: u64, piece_bytes: u64) -> Result<Vec<Piece>, PlanError> {
    if len == 0 {
        return Err(PlanError::ZeroLength);
    }
    if piece_bytes == 0 || piece_bytes % HOST_PAGE_BYTES != 0 {
        return Err(PlanError::BadPieceSize { piece_bytes });
    }
    if base_addr % HOST_PAGE_BYTES != 0 {
        return Err(PlanError::MisalignedBase { base_addr });
    }
    if base_addr.checked_add(len).is_none() || usize::try_from(len).is_err() {
        return Err(PlanError::AddressOverflow { base_addr, len });
    }
    let count = len.div_ceil(piece_bytes);
    if count > MAX_PIECES {
        return Err(PlanError::TooManyPieces {
            pieces: count,
            max: MAX_PIECES,
        });
    }
    let pieces: Vec<Piece> = (0..count)
        .map(|i| {
            let offset = i * piece_bytes;
            Piece {
                offset,
                len: piece_bytes.min(len - offset),
            }
        })
        .collect();
    assert_eq!(pieces.last().map(Piece::end), Some(len));
    Ok(pieces)
}

/// Cuts the copy `[offset, offset + len)` of a region into parts that never
/// cross a piece boundary. `pieces` must be a plan from [`plan_pieces`]
/// (contiguous from 0, in order); a zero-length copy has no parts.
pub fn split_copy(pieces: &[Piece], offset: u64, len: u64) -> Result<SplitCopy<'_>, PlanError> {
    let (first, last) = match (pieces.first(), pieces.last()) {
        (Some(f), Some(l)) => (f, l),
        _ => return Err(PlanError::NoPieces),
    };
    assert_eq!(first.offset, 0, "a piece plan starts at offset 0");
    let region_len = last.end();
    let end = match offset.checked_add(len) {
        Some(end) if end <= region_len => end,
        _ => {
            return Err(PlanError::CopyOutOfRange {
                offset,
                len,
                region_len,
            })
        }
    };
    let index = pieces.partition_point(|p| p.end() <= offset);
    Ok(SplitCopy {
        pieces,
        index,
        pos: offset,
        end,
    })
}

/// Iterator of [`split_copy`].
#[derive(Clone, Debug)]
pub struct SplitCopy<'a> {
    pieces: &'a [Piece],
    index: usize,
    pos: u64,
    end: u64,
}

impl Iterator for SplitCopy<'_> {
    type Item = CopyPart;

    fn next(&mut self) -> Option<CopyPart> {
        if self.pos >= self.end {
            return None;
        }
        let piece = self.pieces[self.index];
        assert!(
            piece.offset <= self.pos && self.pos < piece.end(),
            "piece {piece:?} does not hold offset {} (pieces not contiguous?)",
            self.pos
        );
        let part_end = self.end.min(piece.end());
        let part = CopyPart {
            piece: self.index,
            offset: self.pos,
            len: part_end - self.pos,
        };
        self.pos = part_end;
        self.index += 1;
        Some(part)
    }
}

/// Host memory registered with the driver in pieces
/// (`PORTABLE | DEVICEMAP`: pinned for every context, and mapped so a
/// kernel could address it); unregistered on drop.
pub struct PinnedRegion {
    device: Device,
    base: *mut u8,
    len: u64,
    pieces: Vec<Piece>,
}

impl fmt::Debug for PinnedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedRegion")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("pieces", &self.pieces.len())
            .finish()
    }
}

impl PinnedRegion {
    /// Registers `[base, base + len)` in pieces of `piece_bytes`. If a piece
    /// fails, the pieces already registered are unregistered and the error
    /// names the piece.
    ///
    /// # Safety
    /// The range must be mapped host memory (page-aligned base) that stays
    /// mapped, and is not registered by anyone else, until the returned
    /// region is dropped.
    pub unsafe fn register(
        device: &Device,
        base: *mut u8,
        len: u64,
        piece_bytes: u64,
    ) -> Result<Self, DeviceError> {
        let doing = || {
            format!(
                "pinning {len} bytes at {base:p} for device {}",
                device.ordinal()
            )
        };
        let plan = plan_pieces(base as u64, len, piece_bytes)
            .map_err(|e| DeviceError::invalid(e.to_string(), doing()))?;
        device.bind_current()?;
        let flags =
            (sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP) as c_uint;
        // Grows as pieces register, so dropping it on an error unregisters
        // exactly those.
        let mut region = Self {
            device: device.clone(),
            base,
            len,
            pieces: Vec::with_capacity(plan.len()),
        };
        for (i, piece) in plan.iter().enumerate() {
            // The plan keeps every piece inside [0, len), and len fits usize.
            let ptr = base.wrapping_add(piece.offset as usize).cast::<c_void>();
            let n = piece.len as usize;
            driver_call(
                "cuMemHostRegister_v2",
                || {
                    format!(
                        "{}: piece {i} of {} at offset {}",
                        doing(),
                        plan.len(),
                        piece.offset
                    )
                },
                // SAFETY: symbol checked in Device::open; [ptr, ptr+n) lies
                // inside the caller's mapped range (this function's
                // contract) and was not registered before.
                || unsafe { sys::cuMemHostRegister_v2(ptr, n, flags) },
            )?;
            region.pieces.push(*piece);
        }
        Ok(region)
    }

    pub fn base(&self) -> *mut u8 {
        self.base
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Parts of a copy at `[offset, offset + len)` of this region, each
    /// inside one registration.
    pub fn split_copy(&self, offset: u64, len: u64) -> Result<SplitCopy<'_>, PlanError> {
        split_copy(&self.pieces, offset, len)
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        if self.pieces.is_empty() {
            return;
        }
        self.device.bind_for_drop();
        for piece in self.pieces.iter().rev() {
            let ptr = self
                .base
                .wrapping_add(piece.offset as usize)
                .cast::<c_void>();
            driver_call_in_drop(
                "cuMemHostUnregister",
                || format!("unpinning {} bytes at {ptr:p}", piece.len),
                // SAFETY: `ptr` is the start of a piece registered by
                // register() and unregistered once, here.
                || unsafe { sys::cuMemHostUnregister(ptr) },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn parts(pieces: &[Piece], offset: u64, len: u64) -> Vec<(usize, u64, u64)> {
        split_copy(pieces, offset, len)
            .unwrap()
            .map(|p| (p.piece, p.offset, p.len))
            .collect()
    }

    #[test]
    fn plan_covers_the_region_with_a_short_tail() {
        let p = plan_pieces(0x10_0000, 150 * MIB, 64 * MIB).unwrap();
        assert_eq!(
            p,
            vec![
                Piece {
                    offset: 0,
                    len: 64 * MIB
                },
                Piece {
                    offset: 64 * MIB,
                    len: 64 * MIB
                },
                Piece {
                    offset: 128 * MIB,
                    len: 22 * MIB
                },
            ]
        );
        // Exact multiple: no empty tail piece.
        let p = plan_pieces(0, 128 * MIB, 64 * MIB).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(p[1].end(), 128 * MIB);
        // Smaller than one piece; one byte.
        assert_eq!(
            plan_pieces(4096, 10, DEFAULT_PIECE_BYTES).unwrap(),
            vec![Piece { offset: 0, len: 10 }]
        );
    }

    #[test]
    fn plan_refuses_bad_input() {
        assert_eq!(
            plan_pieces(0, 0, DEFAULT_PIECE_BYTES),
            Err(PlanError::ZeroLength)
        );
        assert_eq!(
            plan_pieces(0, 10, 0),
            Err(PlanError::BadPieceSize { piece_bytes: 0 })
        );
        assert_eq!(
            plan_pieces(0, 10, 4097),
            Err(PlanError::BadPieceSize { piece_bytes: 4097 })
        );
        assert_eq!(
            plan_pieces(4095, 10, 4096),
            Err(PlanError::MisalignedBase { base_addr: 4095 })
        );
        let top = u64::MAX - 4095; // page aligned
        assert_eq!(
            plan_pieces(top, 4096, 4096),
            Err(PlanError::AddressOverflow {
                base_addr: top,
                len: 4096
            })
        );
        assert!(plan_pieces(top, 4095, 4096).is_ok());
        assert_eq!(
            plan_pieces(0, (MAX_PIECES + 1) * 4096, 4096),
            Err(PlanError::TooManyPieces {
                pieces: MAX_PIECES + 1,
                max: MAX_PIECES
            })
        );
        assert!(plan_pieces(0, MAX_PIECES * 4096, 4096).is_ok());
    }

    #[test]
    fn copies_inside_one_piece_are_not_split() {
        let p = plan_pieces(0, 150 * MIB, 64 * MIB).unwrap();
        assert_eq!(parts(&p, 0, 10), vec![(0, 0, 10)]);
        assert_eq!(parts(&p, 64 * MIB - 10, 10), vec![(0, 64 * MIB - 10, 10)]);
        assert_eq!(parts(&p, 64 * MIB, 64 * MIB), vec![(1, 64 * MIB, 64 * MIB)]);
        assert_eq!(parts(&p, 150 * MIB - 1, 1), vec![(2, 150 * MIB - 1, 1)]);
        assert_eq!(parts(&p, 5, 0), vec![]);
        assert_eq!(parts(&p, 150 * MIB, 0), vec![]);
    }

    #[test]
    fn copies_are_cut_exactly_at_boundaries() {
        let p = plan_pieces(0, 150 * MIB, 64 * MIB).unwrap();
        assert_eq!(
            parts(&p, 64 * MIB - 3, 5),
            vec![(0, 64 * MIB - 3, 3), (1, 64 * MIB, 2)]
        );
        assert_eq!(
            parts(&p, 0, 150 * MIB),
            vec![
                (0, 0, 64 * MIB),
                (1, 64 * MIB, 64 * MIB),
                (2, 128 * MIB, 22 * MIB)
            ]
        );
    }

    #[test]
    fn a_copy_spanning_many_pieces_covers_it_exactly() {
        let p = plan_pieces(0, 1000 * 4096 + 123, 4096).unwrap();
        assert_eq!(p.len(), 1001);
        let (offset, len) = (4096 * 7 + 100, 4096 * 900 + 50);
        let got: Vec<CopyPart> = split_copy(&p, offset, len).unwrap().collect();
        assert_eq!(got.len(), 901); // pieces 7..=907
        let mut pos = offset;
        for (i, part) in got.iter().enumerate() {
            assert_eq!(part.offset, pos, "part {i} is not contiguous");
            let piece = p[part.piece];
            assert!(piece.offset <= part.offset && part.offset + part.len <= piece.end());
            assert!(part.len > 0);
            pos += part.len;
        }
        assert_eq!(pos, offset + len);
        assert_eq!(got[0].piece, 7);
        assert_eq!(got[0].len, 4096 - 100);
    }

    #[test]
    fn out_of_range_copies_are_refused_without_overflow() {
        let p = plan_pieces(0, 10 * MIB, 4 * MIB).unwrap();
        let region_len = 10 * MIB;
        for (offset, len) in [
            (0, region_len + 1),
            (region_len, 1),
            (u64::MAX, 1),
            (1, u64::MAX),
        ] {
            assert_eq!(
                split_copy(&p, offset, len).err(),
                Some(PlanError::CopyOutOfRange {
                    offset,
                    len,
                    region_len
                })
            );
        }
        assert_eq!(split_copy(&[], 0, 0).err(), Some(PlanError::NoPieces));
    }

    /// Brute force against a byte-level model: every (offset, len) on a
    /// small region splits into parts that each sit in exactly the piece
    /// holding their bytes.
    #[test]
    fn split_matches_a_byte_model() {
        let piece_bytes = 4096;
        let len = 3 * 4096 + 17;
        let p = plan_pieces(0, len, piece_bytes).unwrap();
        let step = 509; // visits many alignments without a quadratic blow-up
        for offset in (0..=len).step_by(step) {
            for n in (0..=len - offset).step_by(step) {
                let got: Vec<CopyPart> = split_copy(&p, offset, n).unwrap().collect();
                assert_eq!(got.iter().map(|c| c.len).sum::<u64>(), n);
                for c in &got {
                    assert_eq!(c.piece as u64, c.offset / piece_bytes);
                    assert_eq!(c.piece as u64, (c.offset + c.len - 1) / piece_bytes);
                }
                let expected_parts = if n == 0 {
                    0
                } else {
                    (offset + n - 1) / piece_bytes - offset / piece_bytes + 1
                };
                assert_eq!(got.len() as u64, expected_parts, "({offset}, {n})");
            }
        }
    }
}
