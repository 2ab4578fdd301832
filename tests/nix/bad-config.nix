# A keystone.agent configuration with one of each problem `validate`
# (nixos-modules/lib/naming.nix) must report, for tests/nix/check.sh.
# Expected messages: tests/nix/bad-config.expected.json.
{
  defaults.memory = 128;
  # The console on every interface.
  console.listen = "0.0.0.0:8443";
  # The console on the links' site.
  console.host = "console.sandbox.local";
  sandboxes = {
    # Not a valid name (upper case, '_').
    Bad_Name = {
      project = "/srv/src/bad";
      owner = "root";
    };
    # A relative project path.
    rel = {
      project = "src/rel";
      owner = "root";
      memory = 2048;
    };
    # Two names whose derived addresses are the same (10.231.228.180).
    sbx95 = {
      project = "/srv/src/a";
      owner = "root";
      memory = 1024;
    };
    sbx117 = {
      project = "/srv/src/b";
      owner = "root";
      memory = 1024;
      disk = 8;
      envFiles = [ "config/.env" ];
      # Patterns agentd refuses.
      protect = [
        "/etc/passwd"
        "a//b"
        "src/../.git"
        "a**/b"
      ];
    };
    # A secret from a relative file, with no header; a shared agent home on
    # the (default) microvm backend.
    keys = {
      project = "/srv/src/keys";
      memory = 1024;
      agentHome = "shared";
      owner = "root";
      secrets.TOKEN = {
        file = "run/token";
        host = "api.example.com";
      };
      # A push token from a relative file.
      forges = [
        {
          url = "https://github.com/acme/keys";
          tokenFile = "run/push-token";
        }
      ];
    };
  };
}
