//! `aoti_torch_check`: a failed check raises a C++ exception (src/check.cpp),
//! which the generated code's container catches and reports as a failed run,
//! as libtorch's `c10::Error` is. The exception unwinds through this function
//! only (`C-unwind`, no Rust state to clean up), never through a Rust frame
//! that catches.

use std::os::raw::c_char;

extern "C-unwind" {
    fn tcg_shim_check_fail(
        func: *const c_char,
        file: *const c_char,
        line: u32,
        msg: *const c_char,
    ) -> !;
}

/// shim.h: `void aoti_torch_check(bool cond, const char* func, const char*
/// file, uint32_t line, const char* msg)`; returns when `cond` holds, else
/// throws a `std::runtime_error` naming `msg`, `func`, `file` and `line`
/// (each may be null).
///
/// # Safety
/// The pointers are null or NUL-terminated strings; the caller is C++ code
/// that lets the exception reach a handler (the generated code's container).
#[no_mangle]
pub unsafe extern "C-unwind" fn aoti_torch_check(
    cond: bool,
    func: *const c_char,
    file: *const c_char,
    line: u32,
    msg: *const c_char,
) {
    if !cond {
        // SAFETY: the caller's contract; the callee reads the strings and throws.
        unsafe { tcg_shim_check_fail(func, file, line, msg) }
    }
}
