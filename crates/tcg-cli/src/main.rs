fn main() {
    std::process::exit(tcg_cli::run(std::env::args().collect()));
}
