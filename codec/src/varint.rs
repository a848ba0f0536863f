//! Unsigned LEB128 of 32-bit values: at most 5 bytes, minimal encodings only.

use crate::error::DecodeError;

pub fn write(out: &mut Vec<u8>, mut value: u32) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// The length of `value`'s encoding: 1 to 5 bytes.
pub fn len(value: u32) -> usize {
    (32 - value.leading_zeros() as usize).max(1).div_ceil(7)
}

/// Reads a varint at `*offset`, advancing it. `field` names what is read, for errors.
pub fn read(bytes: &[u8], offset: &mut usize, field: &'static str) -> Result<u32, DecodeError> {
    let start = *offset;
    let mut value: u64 = 0;
    for i in 0..5 {
        let Some(&byte) = bytes.get(start + i) else {
            return Err(DecodeError::Truncated { len: bytes.len(), field });
        };
        value |= u64::from(byte & 0x7F) << (7 * i);
        if byte & 0x80 == 0 {
            if i > 0 && byte == 0 {
                return Err(DecodeError::VarintNotMinimal { offset: start });
            }
            if value > u64::from(u32::MAX) {
                return Err(DecodeError::VarintOverflow { offset: start });
            }
            *offset = start + i + 1;
            return Ok(value as u32);
        }
    }
    Err(DecodeError::VarintOverflow { offset: start })
}
