//! Reading manifests from files, directories (recursively) and stdin, all or nothing.

use std::io::Read;
use std::path::{Path, PathBuf};

use boxery_api::codec::{Manifest, parse_manifests};

use crate::exit::{CliError, CliResult};

fn is_manifest(p: &Path) -> bool {
    matches!(
        p.extension().and_then(|e| e.to_str()),
        Some("yaml" | "yml" | "json")
    )
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> CliResult {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| CliError::invalid(format!("cannot read directory {}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for p in entries {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with('.') {
            continue;
        }
        if p.is_dir() {
            walk(&p, out)?;
        } else if is_manifest(&p) {
            out.push(p);
        }
    }
    Ok(())
}

/// Read and validate every manifest named by `-f` arguments. Any bad document fails the whole
/// read before anything is written. Two objects of one kind and name are refused.
pub fn read_all(files: &[String]) -> CliResult<Vec<Manifest>> {
    if files.is_empty() {
        return Err(CliError::invalid(
            "give at least one -f FILE, -f DIR or -f -",
        ));
    }
    let mut out: Vec<Manifest> = Vec::new();
    for f in files {
        let sources: Vec<(String, Vec<u8>)> = if f == "-" {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf)?;
            vec![("<stdin>".to_string(), buf)]
        } else {
            let p = Path::new(f);
            if p.is_dir() {
                let mut files = Vec::new();
                walk(p, &mut files)?;
                if files.is_empty() {
                    return Err(CliError::invalid(format!(
                        "{f}: the directory holds no .yaml, .yml or .json files"
                    )));
                }
                files
                    .into_iter()
                    .map(|p| {
                        let bytes = std::fs::read(&p).map_err(|e| {
                            CliError::invalid(format!("cannot read {}: {e}", p.display()))
                        })?;
                        Ok((p.display().to_string(), bytes))
                    })
                    .collect::<CliResult<_>>()?
            } else {
                let bytes = std::fs::read(p)
                    .map_err(|e| CliError::invalid(format!("cannot read {f}: {e}")))?;
                vec![(f.clone(), bytes)]
            }
        };
        for (name, bytes) in sources {
            out.extend(parse_manifests(&name, &bytes).map_err(CliError::invalid)?);
        }
    }
    for (i, a) in out.iter().enumerate() {
        if let Some(b) = out[..i].iter().find(|b| {
            b.object.kind == a.object.kind && b.object.metadata.name == a.object.metadata.name
        }) {
            return Err(CliError::invalid(format!(
                "{}, document {}: {} {} is also defined in {}, document {}: one apply may name an object only once",
                a.source_name,
                a.document,
                a.object.kind,
                a.object.metadata.name,
                b.source_name,
                b.document
            )));
        }
    }
    Ok(out)
}
