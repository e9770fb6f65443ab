use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tcg_cj::{Map, Value};
use tcg_core::identity;
use tcg_core::Code;

use crate::output::{print_line, Outcome};

/// Compile PyTorch graphs once; resolve verified artifacts everywhere.
#[derive(Debug, Parser)]
#[command(name = "torch-compiled-graphs", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Derive a cg-key-v1 key from its three axes.
    Key {
        /// The graph axis: a class hash (16 hex).
        #[arg(long)]
        graph: String,
        /// The sm axis, such as sm_90 or cpu-x86-64-v3.
        #[arg(long)]
        sm: String,
        /// The toolchain axis (16 hex) ...
        #[arg(
            long,
            conflicts_with = "toolchain",
            required_unless_present = "toolchain"
        )]
        toolchain_axis: Option<String>,
        /// ... or a JSON file holding the toolchain block, folded here.
        #[arg(long)]
        toolchain: Option<PathBuf>,
        /// Print a JSON object instead of the bare key.
        #[arg(long)]
        json: bool,
    },
    /// Check whether a value is a compiled-graph key (exit 0 if so, 1 if not).
    CheckKey {
        /// The value to check.
        value: String,
    },
}

pub fn dispatch(cli: Cli) -> anyhow::Result<Outcome> {
    match cli.command {
        Command::Key {
            graph,
            sm,
            toolchain_axis,
            toolchain,
            json,
        } => {
            let axis = match (toolchain_axis, toolchain) {
                (Some(axis), _) => axis,
                (None, Some(path)) => {
                    let bytes = std::fs::read(&path)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    let block = tcg_cj::parse_strict(&bytes)
                        .with_context(|| format!("{} is not strict JSON", path.display()))?;
                    let block = identity::validate_toolchain_block(
                        &block,
                        Code::DeclarationToolchainInvalid,
                    )
                    .with_context(|| format!("invalid toolchain block in {}", path.display()))?;
                    identity::toolchain_axis(&block)
                }
                (None, None) => unreachable!("clap requires one of them"),
            };
            let key = identity::derive_key(&graph, &sm, &axis)?;
            if json {
                let mut axes = Map::new();
                axes.insert("graph".into(), graph.into());
                axes.insert("sm".into(), sm.into());
                axes.insert("toolchain".into(), axis.into());
                let mut out = Map::new();
                out.insert("axes".into(), Value::Object(axes));
                out.insert("key".into(), key.into());
                print_line(&tcg_cj::to_canonical_string(&Value::Object(out))?)?;
            } else {
                print_line(&key)?;
            }
            Ok(Outcome::Success)
        }
        Command::CheckKey { value } => {
            if identity::is_compiled_graph_key(&value) {
                print_line("valid")?;
                Ok(Outcome::Success)
            } else {
                print_line("invalid")?;
                Ok(Outcome::Negative)
            }
        }
    }
}
