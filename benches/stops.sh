# Sourced by the bench scripts: `at_exit CMD` runs CMD when the bench's shell exits, after the
# commands given before it, so that each service a bench starts is stopped whatever fails.
STOPS=()
at_exit() { STOPS+=("$1"); }
trap 'for ((i = ${#STOPS[@]} - 1; i >= 0; i--)); do eval "${STOPS[i]}"; done' EXIT
