# agentd's tools first on PATH in login shells too (Zellij, the pinned
# agents' launchers at /run/keystone/bin).
case ":$PATH:" in
  *:/run/keystone/bin:*) ;;
  *) PATH=/run/keystone/bin:$PATH ;;
esac
