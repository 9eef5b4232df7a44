# seed-parse.awk — read a boxery NoCloud user-data (the canonical form in docs/images.md) and
# print one record per line, tab-separated:
#   H  hostname
#   K  ssh authorized key
#   F  path  permissions  encoding  content     (one per write_files entry)
# Supported YAML: top-level `key: value`, block lists (`  - item`), write_files items whose
# fields are single-line scalars (plain, 'single' or "double" quoted). Multi-line content must
# be sent with `encoding: b64`. Everything else (bootcmd, users, ...) is skipped.
function unq(s) {
  sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s)
  if (s ~ /^".*"$/) { s = substr(s, 2, length(s) - 2); gsub(/\\"/, "\"", s); gsub(/\\\\/, "\\", s) }
  else if (s ~ /^'.*'$/) { s = substr(s, 2, length(s) - 2); gsub(/''/, "'", s) }
  return s
}
function flush() {
  if (fpath != "") print "F\t" fpath "\t" fperm "\t" fenc "\t" fcontent
  fpath = ""; fperm = ""; fenc = ""; fcontent = ""
}
/^[ \t]*#/ || /^[ \t]*$/ { next }
/^[A-Za-z_][A-Za-z0-9_-]*:/ {
  flush()
  key = $0; sub(/:.*/, "", key); val = $0; sub(/^[^:]*:/, "", val)
  sect = key
  if (key == "hostname") print "H\t" unq(val)
  next
}
sect == "ssh_authorized_keys" && /^[ \t]*-[ \t]/ {
  v = $0; sub(/^[ \t]*-[ \t]*/, "", v); print "K\t" unq(v); next
}
sect == "write_files" {
  line = $0
  if (line ~ /^[ \t]*-[ \t]/) { flush(); sub(/^[ \t]*-[ \t]*/, "", line) } else sub(/^[ \t]+/, "", line)
  if (line ~ /^[a-z_]+:/) {
    k = line; sub(/:.*/, "", k); v = line; sub(/^[^:]*:[ \t]*/, "", v); v = unq(v)
    if (k == "path") fpath = v
    else if (k == "permissions") fperm = v
    else if (k == "encoding") fenc = v
    else if (k == "content") fcontent = v
  }
  next
}
END { flush() }
