# Which options declared by other projects (nixpkgs, microvm.nix) the
# Keystone Agent modules set, checked against tests/nix/foreign-options.json.
# tests/nix/check.sh, section (h), evaluates it:
#
#   nix-instantiate --store dummy:// --eval --strict --json tests/nix/options-set.nix
#
# Without nixpkgs. The modules are imported as they are on disk, each called
# with stubs of what the NixOS module system would pass it (`lib`, `pkgs`,
# `config`, below), and what they return is walked, not merged or checked:
#
# - the walk follows mkIf (into its content whatever the condition), mkMerge
#   (every element), mkDefault/mkForce/mkOverride/mkBefore/mkAfter, and
#   nested attrsets;
# - it stops at a path that matches a listed option (a `<name>` segment
#   matches any key) without forcing the value there;
# - any other place where a definition ends (a list, string, number,
#   function, derivation, or an empty attrset) is an unlisted option;
# - `keystone.*` (our own options, declared in our own files) is skipped.
#
# Roots: the flake's nixosModules.default (flake.nix's outputs called with
# stub inputs: it imports nixos-modules/host, which imports ./options.nix),
# nixos-modules/host on its own, and, for every definition of
# microvm.vms.<name>.config the host module makes, that module (it imports
# nixos-modules/guest) with the keystone.sandbox values the host gives it.
# The keystone.agent values are tests/fixtures/nix-config.nix over the
# defaults the module's own option declarations give.
#
# Result: { malformed; unlisted; unset; pendingSet; set; unlocated; guests; }
# (each explained at the end of the file).
{
  listFile ? ./foreign-options.json,
  fixture ? import ../fixtures/nix-config.nix,
  # Values of the host's config other than keystone.agent that a check
  # wants to set (merged over the stub's, below).
  hostOverrides ? { },
}:
let
  inherit (builtins)
    all
    any
    attrNames
    concatLists
    concatMap
    concatStringsSep
    elem
    elemAt
    filter
    foldl'
    functionArgs
    genList
    hasAttr
    head
    isAttrs
    isFunction
    isList
    isPath
    isString
    length
    listToAttrs
    mapAttrs
    match
    split
    stringLength
    substring
    tail
    ;

  root = toString ../..;

  # --- The list ----------------------------------------------------------------

  listed = (builtins.fromJSON (builtins.readFile listFile)).options;

  splitOption = s: filter isString (split "\\." s);

  patterns = map (entry: {
    inherit (entry) option;
    segments = splitOption entry.option;
    pending = entry.pending or false;
  }) listed;

  segmentMatches = pattern: key: pattern == "<name>" || pattern == key;

  # Does `path` (a list of keys) match the first (length path) segments?
  matchesPrefix =
    segments: path:
    length path <= length segments
    && all (i: segmentMatches (elemAt segments i) (elemAt path i)) (genList (i: i) (length path));

  matching = path: filter (p: length p.segments == length path && matchesPrefix p.segments path) patterns;

  # --- Stub nixpkgs lib --------------------------------------------------------
  # Only what the modules (and flake.nix's nixosModules.default) call. The
  # mk* functions build the same tagged attrsets as nixpkgs' lib/modules.nix
  # (_type "if", "merge", "override", "order"), which is what the walk reads;
  # nothing here merges, type-checks or applies priorities.

  # Options and types: declarations only. mkOption keeps its arguments, and a
  # type keeps what defaultsOf needs (attrsOf/nullOr/submodule structure).
  type = name: extra: { _type = "type"; inherit name; } // extra;
  types = {
    bool = type "bool" { };
    str = type "str" { };
    int = type "int" { };
    port = type "port" { };
    path = type "path" { };
    package = type "package" { };
    attrs = type "attrs" { };
    anything = type "anything" { };
    unspecified = type "unspecified" { };
    deferredModule = type "deferredModule" { };
    ints = {
      positive = type "positive integer" { };
      unsigned = type "unsigned integer" { };
      between = lo: hi: type "integer between ${toString lo} and ${toString hi}" { };
    };
    enum = values: type "enum" { inherit values; };
    listOf = elemType: type "listOf" { inherit elemType; };
    attrsOf = elemType: type "attrsOf" { inherit elemType; };
    nullOr = elemType: type "nullOr" { inherit elemType; };
    submodule = module: type "submodule" { inherit module; };
    coercedTo = from: _f: to: type "coercedTo" { elemType = to; };
    oneOf = alternatives: type "oneOf" { inherit alternatives; };
    either = a: b: type "either" { alternatives = [ a b ]; };
  };

  mkOverride = priority: content: {
    _type = "override";
    inherit priority content;
  };
  mkOrder = priority: content: {
    _type = "order";
    inherit priority content;
  };

  mkOption = attrs: attrs // { _type = "option"; };

  lib = {
    inherit types mkOption mkOverride mkOrder;

    mkIf = condition: content: {
      _type = "if";
      inherit condition content;
    };
    mkMerge = contents: {
      _type = "merge";
      inherit contents;
    };
    mkDefault = mkOverride 1000;
    mkForce = mkOverride 50;
    mkOptionDefault = mkOverride 1500;
    mkBefore = mkOrder 500;
    mkAfter = mkOrder 1500;

    mkEnableOption =
      name:
      mkOption {
        type = types.bool;
        default = false;
        example = true;
        description = "Whether to enable ${name}.";
      };

    # As nixpkgs' lib/modules.nix: a hidden option that throws when used,
    # and an assertion that it is not defined.
    mkRemovedOptionModule =
      optionName: replacementInstructions:
      { options, ... }:
      {
        options = lib.setAttrByPath optionName (mkOption {
          visible = false;
          apply = _: throw "The option `${concatStringsSep "." optionName}' can no longer be used since it's been removed. ${replacementInstructions}";
        });
        config.assertions = [
          {
            assertion = !(lib.attrByPath optionName { isDefined = false; } options).isDefined;
            message = "The option definition `${concatStringsSep "." optionName}' no longer has any effect; please remove it.\n${replacementInstructions}";
          }
        ];
      };

    literalExpression = text: {
      _type = "literalExpression";
      inherit text;
    };
    literalMD = text: {
      _type = "literalMD";
      inherit text;
    };

    # Lists and attrsets (as nixpkgs' lib/lists.nix, lib/attrsets.nix).
    optional = cond: x: if cond then [ x ] else [ ];
    optionals = cond: xs: if cond then xs else [ ];
    optionalAttrs = cond: set: if cond then set else { };
    optionalString = cond: s: if cond then s else "";
    genAttrs = names: f: listToAttrs (map (n: lib.nameValuePair n (f n)) names);
    inherit
      all
      any
      attrNames
      concatLists
      concatMap
      elem
      filter
      genList
      mapAttrs
      ;
    attrValues = builtins.attrValues;
    nameValuePair = name: value: { inherit name value; };
    mapAttrs' = f: set: listToAttrs (map (n: f n set.${n}) (attrNames set));
    mapAttrsToList = f: set: map (n: f n set.${n}) (attrNames set);
    filterAttrs =
      pred: set: listToAttrs (concatMap (n: if pred n set.${n} then [ (lib.nameValuePair n set.${n}) ] else [ ]) (attrNames set));
    setAttrByPath =
      attrPath: value: if attrPath == [ ] then value else { ${head attrPath} = lib.setAttrByPath (tail attrPath) value; };
    attrByPath =
      attrPath: default: set:
      if attrPath == [ ] then
        set
      else if isAttrs set && set ? ${head attrPath} then
        lib.attrByPath (tail attrPath) default set.${head attrPath}
      else
        default;
    recursiveUpdate =
      lhs: rhs:
      lhs
      // mapAttrs (
        n: v: if isAttrs v && isAttrs (lhs.${n} or null) then lib.recursiveUpdate lhs.${n} v else v
      ) rhs;

    # Strings (lib/strings.nix).
    concatStrings = concatStringsSep "";
    inherit concatStringsSep;
    hasPrefix = prefix: s: substring 0 (stringLength prefix) s == prefix;
    removeSuffix =
      suffix: s:
      let
        n = stringLength s - stringLength suffix;
      in
      if n >= 0 && substring n (-1) s == suffix then substring 0 n s else s;
    hasInfix = infix: s: match ".*${lib.escapeRegex infix}.*" s != null;
    escapeRegex = builtins.replaceStrings lib.regexChars (map (c: "\\${c}") lib.regexChars);
    regexChars = [ "\\" "[" "]" "(" ")" "{" "}" "." "*" "+" "?" "^" "$" "|" ];
    toUpper = builtins.replaceStrings lowerChars upperChars;
    toLower = builtins.replaceStrings upperChars lowerChars;

    # A package's program (lib/meta.nix).
    getExe' = pkg: exe: "${pkg}/bin/${exe}";
    getExe = pkg: "${pkg}/bin/${pkg.meta.mainProgram or pkg.pname or pkg.name}";

    versions.majorMinor =
      v:
      let
        parts = builtins.splitVersion v;
      in
      "${elemAt parts 0}.${elemAt parts 1}";

    # The nixpkgs release the configuration is built with: a stand-in.
    trivial.release = "stub";

    # flake.nix's packaging (lib.fileset, lib.licenses, lib.platforms) is
    # left out: nothing of it is forced on the way to nixosModules.default.
  };

  lowerChars = map (i: substring i 1 "abcdefghijklmnopqrstuvwxyz") (genList (i: i) 26);
  upperChars = map (i: substring i 1 "ABCDEFGHIJKLMNOPQRSTUVWXYZ") (genList (i: i) 26);

  # --- Stub pkgs ----------------------------------------------------------------
  # A package stands for itself: an attrset that says it is a derivation
  # (the walk treats it as a value) and is never built.
  package = name: {
    type = "derivation";
    inherit name;
    pname = name;
    version = if name == "zellij" then "0.45.1" else "0";
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
    meta = { };
  };

  pkgs = {
    # The package set's nixpkgs config (the guest reads allowUnfree).
    config = { };
    stdenv.hostPlatform = {
      system = "x86_64-linux";
      isx86_64 = true;
    };
    # Builders: a package named after what they would make.
    writeText = name: _text: package name;
    writeTextDir = path: _text: package (baseNameOf path);
    writeShellScriptBin = name: _text: package name;
    formats.json = _: { generate = name: _value: package name; };
    callPackage = fn: _args: package (lib.removeSuffix ".nix" (baseNameOf fn));
  }
  // lib.genAttrs [
    "openssh"
    "socat"
    "git"
    "nftables"
    "util-linux"
    "claude-code"
    "codex"
    "gemini-cli"
  ] package;

  # --- Stub flake inputs ---------------------------------------------------------
  # nixpkgs gives `lib` and legacyPackages; microvm.nix its modules, which
  # declare options and are not walked (an empty module stands for each).
  inputs = {
    nixpkgs = {
      inherit lib;
      legacyPackages.x86_64-linux = pkgs;
    };
    microvm.nixosModules = {
      host = {
        _file = "microvm.nix nixosModules.host (stub)";
      };
      microvm = {
        _file = "microvm.nix nixosModules.microvm (stub)";
      };
    };
  };
  flake = import ../../flake.nix;
  flakeOutputs = flake.outputs (inputs // { self = flakeOutputs; });

  # --- Modules --------------------------------------------------------------------

  relative =
    file:
    let
      s = toString file;
    in
    if lib.hasPrefix (root + "/") s then substring (stringLength root + 1) (-1) s else s;

  # A module and everything it imports, as the module system reads them
  # (lib/modules.nix, unifyModuleSyntax): a path is imported, a function
  # called with the module arguments, and an attrset without `config` and
  # `options` is all config.
  moduleTree =
    args: name: module:
    let
      isFile = isPath module || isString module;
      file = if isFile then relative module else name;
      loaded = if isFile then import module else module;
      m = if isFunction loaded then loaded args else loaded;
      file' = m._file or file;
      unified =
        if m ? config || m ? options then
          {
            config = m.config or { };
            options = m.options or { };
          }
        else
          {
            config = removeAttrs m [
              "_class"
              "_file"
              "key"
              "disabledModules"
              "require"
              "imports"
              "freeformType"
            ];
            options = { };
          };
    in
    [ (unified // { file = file'; }) ]
    ++ concatMap (moduleTree args "${file'} (an import)") (m.imports or [ ]);

  # The option declarations of a module tree, merged (an attrset of options
  # and nested attrsets of them).
  declarations =
    tree:
    let
      merge =
        a: b:
        a
        // mapAttrs (
          n: v: if isAttrs v && (v._type or null) != "option" && isAttrs (a.${n} or null) then merge a.${n} v else v
        ) b;
    in
    foldl' merge { } (map (m: m.options) tree);

  # Option values with the defaults the declarations give (what the module
  # system computes for options nobody else defines): `value` is what a
  # configuration sets, `absent` where it sets nothing; submodules
  # (attrsOf/nullOr of one) get their defaults too. Values the declarations
  # do not know are kept.
  absent = {
    _type = "absent";
  };
  defaultsOf =
    decls: value:
    if (decls._type or null) == "option" then
      if value == absent then
        decls.default or (throw "options-set.nix: the stub config needs a value for an option without a default")
      else
        withType (decls.type or { }) value
    else
      let
        set = if isAttrs value && value != absent then value else { };
      in
      set // mapAttrs (n: d: defaultsOf d (set.${n} or absent)) decls;

  withType =
    t: value:
    if value == null then
      null
    else if t.name or "" == "submodule" then
      defaultsOf (submoduleOptions t.module null) value
    else if t.name or "" == "attrsOf" && (t.elemType.name or "") == "submodule" then
      mapAttrs (n: v: defaultsOf (submoduleOptions t.elemType.module n) v) value
    else if t.name or "" == "nullOr" then
      withType t.elemType value
    else
      value;

  submoduleOptions =
    module: name:
    let
      m = if isFunction module then module { inherit lib name pkgs; } else module;
    in
    m.options or { };

  # The definitions a module tree makes at `path` (through mkIf, mkMerge and
  # the priority wrappers), merged with `//`.
  definitionsAt =
    path: value:
    let
      v = value;
      t = if isAttrs v then v._type or null else null;
    in
    if t == "if" || t == "override" || t == "order" then
      definitionsAt path v.content
    else if t == "merge" then
      concatMap (definitionsAt path) v.contents
    else if path == [ ] then
      [ v ]
    else if isAttrs v && v ? ${head path} then
      definitionsAt (tail path) v.${head path}
    else
      [ ];

  valuesAt = path: tree: foldl' (a: b: a // b) { } (concatMap (m: definitionsAt path m.config) tree);

  # --- What the modules set, as values ------------------------------------------------
  # The definitions of a module tree merged into one value: mkIf by its
  # condition, the priority wrappers taken off, mkMerge elements and
  # attrsets merged key by key (lists concatenated, strings joined as
  # lines). Priorities are not compared: this tells what the modules
  # define, for tests/nix/check.sh to look at, not what NixOS makes of it
  # with other modules' definitions. Lazy: only what a check reads is
  # forced. A key defined under a false mkIf holds `nothing`.
  nothing = {
    _type = "nothing";
  };
  isNothing = v: isAttrs v && (v._type or null) == "nothing";
  isPlainSet = v: isAttrs v && !(isDerivation v) && (v._type or null) == null;
  resolve =
    v:
    let
      t = if isAttrs v then v._type or null else null;
    in
    if t == "if" then
      (if v.condition then resolve v.content else nothing)
    else if t == "override" || t == "order" then
      resolve v.content
    else if t == "merge" then
      foldl' mergeDefs nothing (map resolve v.contents)
    else if isPlainSet v then
      mapAttrs (_: resolve) v
    else
      v;
  mergeDefs =
    a: b:
    if isNothing a then
      b
    else if isNothing b then
      a
    else if isPlainSet a && isPlainSet b then
      a // b // mapAttrs (n: _: mergeDefs a.${n} b.${n}) (builtins.intersectAttrs a b)
    else if isList a && isList b then
      a ++ b
    else if isString a && isString b then
      a + "\n" + b
    else
      b;
  resolveTree = tree: foldl' mergeDefs nothing (map (m: resolve m.config) tree);

  # --- The walk ---------------------------------------------------------------------

  isDerivation = v: (v.type or null) == "derivation";

  showPath = path: concatStringsSep "." (map showKey path);
  showKey = key: if match "[A-Za-z_][A-Za-z0-9_'-]*" key != null then key else "\"${key}\"";

  # An entry whose last segment is `<name>` stands for a whole element of an
  # attrsOf (`users.groups.<name>`): it matches where the element's
  # definition is empty or not an attrset. Where the element's definition
  # has keys, the walk goes on into them, and those need entries of their own.
  # Any other entry matches whatever is defined at its path, unforced.
  isElement = p: elemAt p.segments (length p.segments - 1) == "<name>";

  walk =
    file: path: value:
    let
      hits = matching path;
      options = filter (p: !isElement p) hits;
      elements = filter isElement hits;
      t = if isAttrs value then value._type or null else null;
      set = p: [
        {
          kind = "set";
          inherit (p) option;
          inherit file path value;
        }
      ];
    in
    if path == [ "keystone" ] then
      [ ]
    else if options != [ ] then
      set (head options)
    else if t == "if" || t == "override" || t == "order" then
      walk file path value.content
    else if t == "merge" then
      concatMap (walk file path) value.contents
    else if isAttrs value && t == null && !(isDerivation value) && attrNames value != [ ] then
      concatMap (key: walk file (path ++ [ key ]) value.${key}) (attrNames value)
    else if elements != [ ] then
      set (head elements)
    else if path == [ ] && value == { } then
      # A module that sets nothing.
      [ ]
    else
      [
        {
          kind = "unlisted";
          inherit file path;
        }
      ];

  walkTree = tree: concatMap (m: walk m.file [ ] m.config) tree;

  # --- Host ---------------------------------------------------------------------------

  # The host's config as the modules read it: keystone.agent from the
  # fixture over the declared defaults; the rest are the values a NixOS
  # system has unless it sets them (users-groups.nix declares root and
  # nobody; no nftables firewall).
  hostConfig = tree: lib.recursiveUpdate (hostStub tree) hostOverrides;
  hostStub = tree: {
    keystone.agent = defaultsOf (declarations tree).keystone.agent fixture;
    # microvm.nix's host module: its default state directory, and its
    # /etc/qemu/bridge.conf (`allow all` with lib.mkDefault) merged with
    # the module's definition of the same priority.
    microvm.stateDir = "/var/lib/microvms";
    environment.etc."qemu/bridge.conf".text =
      "allow all\n" + ((resolveTree tree).environment.etc."qemu/bridge.conf".text or "");
    users.users = {
      root = {
        uid = 0;
        group = "root";
        extraGroups = [ ];
      };
      nobody = {
        uid = 65534;
        group = "nogroup";
        extraGroups = [ ];
      };
    };
    users.groups = { };
    networking.nftables = {
      enable = false;
      ruleset = "";
    };
  };

  moduleArgs = config: {
    inherit config lib pkgs;
    # Read only by mkRemovedOptionModule's assertion (a value never forced).
    options = { };
    modulesPath = "/nixpkgs/nixos/modules";
  };

  # A root module evaluated with a config computed from its own tree.
  evalRoot =
    name: module: mkConfig:
    let
      tree = moduleTree (moduleArgs (mkConfig tree)) name module;
    in
    walkTree tree;

  hostRoots = [
    (evalRoot "flake.nix nixosModules.default" flakeOutputs.nixosModules.default hostConfig)
    (evalRoot "nixos-modules/host" ../../nixos-modules/host hostConfig)
  ];

  # nixos-modules/host's definitions as one value (see resolve).
  hostTree =
    let
      tree = moduleTree (moduleArgs (hostConfig tree)) "nixos-modules/host" ../../nixos-modules/host;
    in
    tree;
  hostValues = resolveTree hostTree;
  hostRecords = concatLists hostRoots;

  # --- Guests ----------------------------------------------------------------------------

  # microvm.vms.<name>.config as the host defines it: one or more modules.
  guestModules = concatMap (r: definitionsAt [ ] r.value) (
    filter (r: r.kind == "set" && r.option == "microvm.vms.<name>.config") hostRecords
  );

  guestConfig = vmModule: tree: {
    keystone.sandbox = defaultsOf (declarations tree).keystone.sandbox (valuesAt [ "keystone" "sandbox" ] tree);
    networking.nftables.enable = false;
  };

  guestRecords = concatMap (
    vmModule: evalRoot "microvm.vms.<name>.config" vmModule (guestConfig vmModule)
  ) guestModules;

  # nixos-modules/guest's definitions as one value, with keystone.sandbox
  # set to `values` over the declared defaults (see resolve).
  guestWith =
    values:
    let
      tree = moduleTree (moduleArgs {
        keystone.sandbox = defaultsOf (declarations tree).keystone.sandbox values;
        networking.nftables.enable = false;
      }) "nixos-modules/guest" ../../nixos-modules/guest;
    in
    resolveTree tree;

  # The messages of the assertions that fail in a resolved config.
  failing = values: map (a: a.message) (filter (a: !a.assertion) (values.assertions or [ ]));

  # --- Result -------------------------------------------------------------------------------

  records = hostRecords ++ guestRecords;

  unique = foldl' (acc: x: if elem x acc then acc else acc ++ [ x ]) [ ];

  setOptions = unique (map (r: r.option) (filter (r: r.kind == "set") records));
  # An entry names its option, the project that declares it and where: file,
  # line and the revision the line was read at.
  wellFormed =
    e:
    builtins.isString (e.option or null)
    && elem (e.project or null) [
      "nixpkgs"
      "microvm.nix"
    ]
    && builtins.isString (e.file or null)
    && (
      builtins.isInt (e.line or null) && builtins.isString (e.rev or null) && match "[0-9a-f]{40}" e.rev != null
      # Not looked up yet: both null, and a note that says so.
      || (e.line or 0) == null && (e.rev or 0) == null && builtins.isString (e.note or null)
    )
    && builtins.isBool (e.pending or false);
  names = map (e: e.option or null) listed;
in
{
  # Entries without option, project, file, line or rev, or listed twice.
  malformed =
    map (e: e.option or (builtins.toJSON e)) (filter (e: !wellFormed e) listed)
    ++ map (n: "${n} (listed twice)") (
      unique (filter (n: length (filter (m: m == n) names) > 1) names)
    );
  # Where the modules set an option the list does not have: "path (file)".
  unlisted = unique (map (r: "${showPath r.path} (${r.file})") (filter (r: r.kind == "unlisted") records));
  # Listed options (not pending) that no module sets.
  unset = map (p: p.option) (filter (p: !p.pending && !(elem p.option setOptions)) patterns);
  # Listed as pending (about to be set) but set already: drop "pending".
  pendingSet = map (p: p.option) (filter (p: p.pending && elem p.option setOptions) patterns);
  # Listed options that are set.
  set = setOptions;
  # Entries whose declaration (line, rev) is not recorded yet.
  unlocated = map (e: e.option) (filter (e: (e.line or 0) == null) listed);
  # How many definitions of microvm.vms.<name>.config were walked as guests.
  guests = length guestModules;

  # For tests/nix/check.sh's checks of single settings: the host module's
  # definitions with the fixture, the guest module's with given
  # keystone.sandbox values, and the failing assertions of either.
  host = hostValues;
  hostFailing = failing hostValues;
  inherit guestWith;
  guestFailing = values: failing (guestWith values);
}
