//! Metadata values and typed look-ups.

use std::collections::BTreeMap;

use super::GgufError;
use super::reader::Cursor;

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// Unsigned integer (u8, u16, u32, u64 on disk).
    U64(u64),
    /// Signed integer (i8, i16, i32, i64 on disk).
    I64(i64),
    /// Float (f32, f64 on disk).
    F64(f64),
    /// Boolean.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array of values (GGUF arrays are homogeneous).
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as a non-negative integer, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U64(v) => Some(v),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a signed integer, if it is an integer.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::U64(v) => i64::try_from(v).ok(),
            Self::I64(v) => Some(v),
            _ => None,
        }
    }
    /// The value as a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F64(v) => Some(v),
            Self::U64(v) => Some(v as f64),
            Self::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            _ => None,
        }
    }
    /// The items, if this is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
    /// The boolean, if this is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }
}

/// Nested arrays deeper than this are treated as corrupt (real files nest at most once).
const MAX_DEPTH: usize = 4;

pub(super) fn read_value(cur: &mut Cursor<'_>, depth: usize) -> Result<MetaValue, GgufError> {
    let ty = cur.u32()?;
    read_typed(cur, ty, depth)
}

fn read_typed(cur: &mut Cursor<'_>, ty: u32, depth: usize) -> Result<MetaValue, GgufError> {
    let at = cur.pos();
    Ok(match ty {
        0 => MetaValue::U64(cur.u8()?.into()),
        1 => MetaValue::I64((cur.u8()? as i8).into()),
        2 => MetaValue::U64(cur.u16()?.into()),
        3 => MetaValue::I64((cur.u16()? as i16).into()),
        4 => MetaValue::U64(cur.u32()?.into()),
        5 => MetaValue::I64((cur.u32()? as i32).into()),
        6 => MetaValue::F64(cur.f32()?.into()),
        7 => match cur.u8()? {
            0 => MetaValue::Bool(false),
            1 => MetaValue::Bool(true),
            b => {
                return Err(GgufError::Corrupt {
                    offset: at,
                    what: format!("bool byte {b}"),
                });
            }
        },
        8 => MetaValue::Str(cur.string()?),
        9 => {
            if depth >= MAX_DEPTH {
                return Err(GgufError::Corrupt {
                    offset: at,
                    what: "arrays nested too deeply".into(),
                });
            }
            let item_ty = cur.u32()?;
            let n = cur.count("array length", min_bytes(item_ty))?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_typed(cur, item_ty, depth + 1)?);
            }
            MetaValue::Array(items)
        }
        10 => MetaValue::U64(cur.u64()?),
        11 => MetaValue::I64(cur.u64()? as i64),
        12 => MetaValue::F64(cur.f64()?),
        other => {
            return Err(GgufError::Corrupt {
                offset: at,
                what: format!("metadata value type {other}"),
            });
        }
    })
}

/// The fewest bytes one item of a type can take, to bound array lengths.
fn min_bytes(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

/// All metadata of a file, with typed getters whose errors name the key.
#[derive(Clone, Debug, Default)]
pub struct Metadata {
    map: BTreeMap<String, MetaValue>,
}

impl Metadata {
    pub(super) fn insert(&mut self, key: String, value: MetaValue) {
        self.map.insert(key, value);
    }

    /// The raw value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.map.get(key)
    }

    /// All keys and values in key order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetaValue)> {
        self.map.iter().map(|(k, v)| (k.as_str(), v))
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        want: &str,
        f: impl Fn(&'a MetaValue) -> Option<T>,
    ) -> Result<T, GgufError> {
        let v = self.map.get(key).ok_or_else(|| GgufError::Key {
            key: key.into(),
            problem: "missing".into(),
        })?;
        f(v).ok_or_else(|| GgufError::Key {
            key: key.into(),
            problem: format!("expected {want}, found {v:?}"),
        })
    }

    /// A required non-negative integer.
    pub fn u64(&self, key: &str) -> Result<u64, GgufError> {
        self.typed(key, "an unsigned integer", MetaValue::as_u64)
    }
    /// A required float.
    pub fn f64(&self, key: &str) -> Result<f64, GgufError> {
        self.typed(key, "a number", MetaValue::as_f64)
    }
    /// A required string.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        self.typed(key, "a string", MetaValue::as_str)
    }
    /// A required array.
    pub fn array(&self, key: &str) -> Result<&[MetaValue], GgufError> {
        self.typed(key, "an array", MetaValue::as_array)
    }
    /// An optional integer (absent → `None`, present with the wrong type → error).
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.map.get(key).map(|_| self.u64(key)).transpose()
    }
    /// An optional float.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.map.get(key).map(|_| self.f64(key)).transpose()
    }
    /// An optional boolean.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.map
            .get(key)
            .map(|_| self.typed(key, "a boolean", MetaValue::as_bool))
            .transpose()
    }
    /// An optional string.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.map.get(key).map(|_| self.str(key)).transpose()
    }
}
