//! `kvshard`: a thread-per-core KV-cache server, a drop-in for lmcache 0.5.6's
//! `lmcache server`.

mod cli;
mod logger;

use clap::Parser;

fn main() {
    let cli = cli::Cli::parse();
    match cli.command {
        cli::Command::Server(args) => {
            logger::init();
            let (cfg, notes) = match args.into_config() {
                Ok(v) => v,
                Err(e) => {
                    eprintln!("kvshard server: {e}");
                    std::process::exit(2);
                }
            };
            for n in notes {
                log::info!("{n}");
            }
            if let Err(e) = kvshard_transport::server::run(cfg) {
                log::error!("{e}");
                eprintln!("kvshard server: {e}");
                std::process::exit(1);
            }
        }
    }
}
