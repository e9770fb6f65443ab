//! The `torch-compiled-graphs` command line.
//!
//! Exit codes: 0 success, 1 an expected negative (a miss, a refused
//! verification, an invalid key), 2 usage or unexpected errors. Data goes to
//! stdout (`--json` output is stable); messages go to stderr as `error: …`
//! followed by an optional `hint: …`.
#![deny(missing_docs)]

mod adopt;
mod commands;
mod explain;
mod fleet;
mod output;

use clap::Parser;

pub use output::Outcome;

/// Parse `argv` (program name first), run the command and return its exit code.
/// Path arguments are taken as the OS gives them; any other argument that is
/// not UTF-8 is a usage error (exit 2).
pub fn run<I, T>(argv: I) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let cli = match commands::Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    if let Some(name) = cli.python_command() {
        // `build`, `build-cell` and `toolchain` import torch and user recipes: the
        // console script routes them to Python before it forwards anything here.
        eprintln!("error: `{name}` runs in Python (it needs torch), not in this binary");
        eprintln!(
            "hint: run `torch-compiled-graphs {name} ...` (the Python console script) or \
             `python -m torch_compiled_graphs {name} ...`"
        );
        return 2;
    }
    match commands::dispatch(cli) {
        Ok(outcome) => outcome.exit_code(),
        Err(err) => output::report_error(&err),
    }
}
