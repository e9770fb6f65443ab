fn main() {
    // Arguments as the OS gives them: a path need not be UTF-8, and any other
    // argument that is not is a usage error (exit 2), never a panic.
    std::process::exit(tcg_cli::run(std::env::args_os()));
}
