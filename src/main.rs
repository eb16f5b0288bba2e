fn main() -> std::process::ExitCode {
    stowage::cli::main()
}
