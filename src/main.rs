//! `kvshard`: a thread-per-core KV-cache server, a drop-in for lmcache 0.5.6's
//! `lmcache server`.

mod cli;
mod loadgen;
mod logger;
mod yaml_config;

use clap::Parser;

fn main() {
    let (argv, config_notes) = match yaml_config::expand_args(std::env::args().collect()) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("kvshard server: {e}");
            std::process::exit(2);
        }
    };
    let cli = cli::Cli::parse_from(argv);
    match cli.command {
        cli::Command::Server(args) => {
            logger::init(args.kvshard.log_format);
            abort_on_panic();
            for n in config_notes {
                log::info!("{n}");
            }
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
        cli::Command::Loadgen(args) => std::process::exit(loadgen::run(args)),
    }
}

/// A panic means a broken invariant (bad input never panics): a shard that died
/// would leave its objects unreachable and the front waiting on its mailbox, so
/// stop the whole process loudly and let the supervisor restart it.
fn abort_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        log::error!("fatal: {info}; aborting");
        std::process::abort();
    }));
}
