//! The rules of greedy picks that both backends enforce: at most [`MAX_PENDING`] pending at
//! once, waited for in order, embedded with the row count they were picked with.

use crate::Error;

/// Most picks that may be pending at once (the GPU's double-buffered host copy).
pub(crate) const MAX_PENDING: usize = 2;

/// Checks that the latest pick has the `rows` rows a step embeds.
pub(crate) fn check_rows(picked: usize, rows: usize) -> Result<(), Error> {
    if picked != rows {
        return Err(Error::Shape {
            op: "embed_picks",
            detail: format!("the last pick has {picked} rows, the step {rows}"),
        });
    }
    Ok(())
}

/// The error of a third pending pick.
pub(crate) fn too_many_pending() -> Error {
    Error::Shape {
        op: "pick_greedy",
        detail: format!("{MAX_PENDING} picks are already pending; wait for one first"),
    }
}

/// The error of waiting with no pick pending.
pub(crate) fn nothing_pending() -> Error {
    Error::Shape {
        op: "wait_picks",
        detail: "no pick is pending".into(),
    }
}

/// The error of embedding picks before any was made.
pub(crate) fn nothing_picked() -> Error {
    Error::Shape {
        op: "embed_picks",
        detail: "no greedy pick has been made yet".into(),
    }
}
