//! The shape error both backends report for arguments that do not fit together.

use crate::Error;

/// [`Error::Shape`] of `op` with `detail`.
pub(crate) fn shape(op: &'static str, detail: String) -> Error {
    Error::Shape { op, detail }
}

/// Checks the arguments of [`crate::Backend::short_conv`] on every backend: `bcx` of
/// `bcx_rows × bcx_cols` against `h` output channels, `kernel_len` taps·channels, one state
/// per span (`state_lens`, each `keep · h` with `keep ≥ taps − 1`) and spans inside `bcx`.
/// Returns the taps.
pub(crate) fn check_short_conv(
    bcx_rows: usize,
    bcx_cols: usize,
    h: usize,
    kernel_len: usize,
    spans: &[crate::SeqSpan<'_>],
    state_lens: &[usize],
) -> Result<usize, Error> {
    let op = "short_conv";
    if bcx_cols != 3 * h {
        return Err(shape(
            op,
            format!("tensor has {bcx_cols} columns, expected {}", 3 * h),
        ));
    }
    if h == 0 || kernel_len == 0 || !kernel_len.is_multiple_of(h) {
        return Err(shape(
            op,
            format!("{kernel_len} kernel values for {h} channels"),
        ));
    }
    let taps = kernel_len / h;
    if state_lens.len() != spans.len() {
        return Err(shape(
            op,
            format!("{} states for {} sequences", state_lens.len(), spans.len()),
        ));
    }
    for (sp, &len) in spans.iter().zip(state_lens) {
        let keep = len / h;
        if len != keep * h || keep + 1 < taps {
            return Err(shape(
                op,
                format!("a state of {len} values for {h} channels and {taps} taps"),
            ));
        }
        let end = sp.first_row + sp.n_tokens;
        if end > bcx_rows {
            return Err(shape(
                op,
                format!("rows {}..{end} of {bcx_rows}", sp.first_row),
            ));
        }
    }
    Ok(taps)
}
