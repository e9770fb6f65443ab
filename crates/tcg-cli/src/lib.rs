//! The `torch-compiled-graphs` command line.
//!
//! Exit codes: 0 success, 1 an expected negative (a miss, a refused
//! verification, an invalid key), 2 usage or unexpected errors. Data goes to
//! stdout (`--json` output is stable); messages go to stderr as `error: …`
//! followed by an optional `hint: …`.
#![deny(missing_docs)]

mod adopt;
mod commands;
mod fleet;
mod output;

use clap::Parser;

pub use output::Outcome;

/// Parse `argv` (program name first), run the command and return its exit code.
pub fn run(argv: Vec<String>) -> i32 {
    let cli = match commands::Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match commands::dispatch(cli) {
        Ok(outcome) => outcome.exit_code(),
        Err(err) => output::report_error(&err),
    }
}
