//! The shape error both backends report for arguments that do not fit together.

use crate::Error;

/// [`Error::Shape`] of `op` with `detail`.
pub(crate) fn shape(op: &'static str, detail: String) -> Error {
    Error::Shape { op, detail }
}
