//! Generates the libfabric bindings with bindgen from the system headers (found through
//! pkg-config) and compiles the C shim that exports the headers' static-inline calls.

use std::env;
use std::path::PathBuf;

use bindgen::callbacks::{IntKind, ParseCallbacks};

/// Oldest libfabric whose headers and providers this crate is tested against.
const MIN_VERSION: &str = "1.17";

/// Gives the `FI_*` flag macros one Rust type (`u64`, the type of libfabric's flag words) and the
/// error numbers `FI_E*` the C `int` type, instead of bindgen's guess from each value.
#[derive(Debug)]
struct MacroTypes;

impl ParseCallbacks for MacroTypes {
    fn int_macro(&self, name: &str, _value: i64) -> Option<IntKind> {
        if name.starts_with("FI_E") && !name.starts_with("FI_EP_") {
            Some(IntKind::Int)
        } else if name.starts_with("FI_") {
            Some(IntKind::U64)
        } else {
            None
        }
    }
}

fn main() {
    println!("cargo:rerun-if-changed=shim/kvx_fi_shim.h");
    println!("cargo:rerun-if-changed=shim/kvx_fi_shim.c");
    println!("cargo:rerun-if-env-changed=LIBFABRIC_NO_PKG_CONFIG");

    // Headers only: the shim opens the shared library at run time (kvx_fi_load), so nothing
    // links it.
    let library = match pkg_config::Config::new()
        .atleast_version(MIN_VERSION)
        .cargo_metadata(false)
        .probe("libfabric")
    {
        Ok(library) => library,
        Err(error) => {
            panic!(
                "libfabric >= {MIN_VERSION} was not found through pkg-config ({error}); \
                 install the distribution's development package (Debian: libfabric-dev)"
            );
        }
    };

    let mut shim = cc::Build::new();
    shim.file("shim/kvx_fi_shim.c").warnings(true);
    for path in &library.include_paths {
        shim.include(path);
    }
    shim.compile("kvx_fi_shim");
    // dlopen: in glibc's libc since 2.34, in libdl before.
    println!("cargo:rustc-link-lib=dl");

    let mut builder = bindgen::Builder::default()
        .header("shim/kvx_fi_shim.h")
        .parse_callbacks(Box::new(MacroTypes))
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .allowlist_function("kvx_fi_.*")
        .allowlist_type("fi_.*")
        .allowlist_type("fid_.*")
        .allowlist_var("FI_.*")
        .default_enum_style(bindgen::EnumVariation::ModuleConsts)
        .wrap_unsafe_ops(true)
        .derive_default(true)
        .derive_debug(true)
        .layout_tests(true)
        .generate_comments(false);
    for path in &library.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen failed to generate the libfabric bindings");

    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("could not write the generated bindings");
}
