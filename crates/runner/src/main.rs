//! `onepass`: the one binary. Specs, datasets, settings, results and reports land with the
//! runner issue; until then it only lists the estimators the library provides.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("estimators") => {
            for k in estimators::Kind::ALL {
                println!("{k}");
            }
        }
        _ => {
            eprintln!("onepass: `run`, `report` and `compare` are not implemented yet (runner issue); try `onepass estimators`");
            std::process::exit(2);
        }
    }
}
