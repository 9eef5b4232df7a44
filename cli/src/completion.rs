//! `completion SHELL`: clap's generated script for commands and flags, and for bash, zsh and
//! fish a wrapper that completes object names (`boxery get vm <TAB>`, `boxery describe vm/<TAB>`) by
//! asking `boxery __complete-names KIND`, which reads the store of `$BOXERY_HOME` (or the
//! default home) and never creates one.

use std::path::Path;

use boxery_verbs::{Verbs, Voice};
use clap_complete::Shell;

use crate::exit::CliResult;
use crate::out::out;

/// The commands whose arguments after the kind are object names.
const TAKE_NAMES: &str = "get describe delete edit patch label annotate wait scale";

/// zsh: object names after `boxery VERB KIND`, and KIND/NAME anywhere; else clap's completion.
const ZSH_NAMES: &str = r#"# Object names (boxery's own addition): after `boxery VERB KIND`, and KIND/NAME anywhere.
_boxery() {
    local i verb="" at=0 cur="${words[CURRENT]}" kind
    local -a names
    for ((i = 2; i < CURRENT; i++)); do
        case "${words[i]}" in
            --home|--backend) ((i++)) ;;
            -*) ;;
            *) verb="${words[i]}"; at=$i; break ;;
        esac
    done
    case " {TAKE_NAMES} " in
        *" $verb "*)
            if [[ "$cur" == */* ]]; then
                kind="${cur%%/*}"
                names=(${(f)"$(boxery __complete-names "$kind" 2>/dev/null)"})
                compadd -- "${names[@]/#/$kind/}"
                return 0
            fi
            if (( at > 0 && CURRENT > at + 1 )) && [[ "$cur" != -* ]]; then
                kind="${words[at + 1]}"
                names=(${(f)"$(boxery __complete-names "$kind" 2>/dev/null)"})
                compadd -- "${names[@]}"
                return 0
            fi
            ;;
    esac
    _boxery_flags "$@"
}

"#;

/// fish: object names after `boxery VERB KIND`, and KIND/NAME.
const FISH_NAMES: &str = r#"
# Object names (boxery's own addition): after `boxery VERB KIND`, and KIND/NAME.
function __boxery_names_slash
    set -l kind (string split -m1 / -- (commandline -ct))[1]
    for n in (boxery __complete-names $kind 2>/dev/null)
        echo $kind/$n
    end
end
complete -c boxery -n '__fish_seen_subcommand_from {TAKE_NAMES}; and string match -q "*/*" -- (commandline -ct)' -f -a '(__boxery_names_slash)'
complete -c boxery -n '__fish_seen_subcommand_from {TAKE_NAMES}; and test (count (commandline -opc)) -ge 3' -f -a '(boxery __complete-names (commandline -opc)[3] 2>/dev/null)'
"#;

/// The script for `shell`.
pub fn script(shell: Shell, cmd: &mut clap::Command) -> String {
    let mut buf = Vec::new();
    clap_complete::generate(shell, cmd, "boxery", &mut buf);
    let mut s = String::from_utf8_lossy(&buf).into_owned();
    match shell {
        Shell::Bash => s.push_str(&format!(
            r#"
# Object names (boxery's own addition): after `boxery VERB KIND`, and KIND/NAME anywhere.
_boxery_with_names() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" i verb="" at=0
    for ((i = 1; i < COMP_CWORD; i++)); do
        case "${{COMP_WORDS[i]}}" in
            --home|--backend) ((i++)) ;;
            -*) ;;
            *) verb="${{COMP_WORDS[i]}}"; at=$i; break ;;
        esac
    done
    case " {TAKE_NAMES} " in
        *" $verb "*)
            if [[ "$cur" == */* ]]; then
                local kind="${{cur%%/*}}" n
                COMPREPLY=()
                while IFS= read -r n; do
                    [[ "$kind/$n" == "$cur"* ]] && COMPREPLY+=("$kind/$n")
                done < <(boxery __complete-names "$kind" 2>/dev/null)
                return 0
            fi
            if ((at > 0 && COMP_CWORD > at + 1)) && [[ "$cur" != -* ]]; then
                local kind="${{COMP_WORDS[at + 1]}}"
                COMPREPLY=($(compgen -W "$(boxery __complete-names "$kind" 2>/dev/null)" -- "$cur"))
                return 0
            fi
            ;;
    esac
    _boxery "$@"
}}
complete -F _boxery_with_names -o nosort -o bashdefault -o default boxery
"#
        )),
        Shell::Zsh => {
            // clap's `_boxery` becomes `_boxery_flags`; `_boxery` (the name `#compdef` and
            // autoload use) completes names first, then falls back to it.
            s = s.replacen("\n_boxery() {\n", "\n_boxery_flags() {\n", 1);
            let at = s
                .rfind("if [ \"$funcstack[1]\" = \"_boxery\" ]")
                .unwrap_or(s.len());
            s.insert_str(at, &ZSH_NAMES.replace("{TAKE_NAMES}", TAKE_NAMES));
        }
        Shell::Fish => s.push_str(&FISH_NAMES.replace("{TAKE_NAMES}", TAKE_NAMES)),
        _ => {}
    }
    s
}

/// `__complete-names KIND`: the names of the kind's objects, one per line; nothing when the home
/// has no store yet (completion never creates a home) or the kind is unknown.
pub async fn names(env: boxery_verbs::Env, kind: &str) -> CliResult {
    if !boxery_home::layout::store(Path::new(&env.home)).exists() {
        return Ok(());
    }
    let Ok(info) = boxery_verbs::objects::kind(kind) else {
        return Ok(());
    };
    let v = Verbs::open(env, Voice::Cli)?;
    let mut text = String::new();
    for name in v.names(info.kind).await? {
        // names are validated on write (no whitespace or control characters), so one per line
        text.push_str(&name);
        text.push('\n');
    }
    out!("{text}");
    Ok(())
}
