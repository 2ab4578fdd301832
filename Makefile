# Build and install Keystone Agent: agentd, keystone-relay and agentctl, the
# D-Bus and systemd files, shell completions and man pages. docs/install.md
# describes the installed layout.
#
#   make                                  # cargo build --release, then the generated files
#   sudo make install                     # into /usr/local
#   make install PREFIX=/usr DESTDIR=$pkgdir SYSTEMDSYSTEMUNITDIR=/usr/lib/systemd/system
#   sudo make uninstall                   # the same variables as install
#
# `install` does not run cargo when the binaries are built, so that
# `make && sudo make install` compiles nothing as root.

PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
DATADIR ?= $(PREFIX)/share
MANDIR ?= $(DATADIR)/man
SYSTEMDSYSTEMUNITDIR ?= $(PREFIX)/lib/systemd/system
SYSTEMDUSERUNITDIR ?= $(PREFIX)/lib/systemd/user
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
DBUSDIR ?= $(DATADIR)/dbus-1
# The system bus reads policies from /usr/share/dbus-1/system.d and
# /etc/dbus-1/system.d only: /etc/dbus-1/system.d for a /usr/local install.
DBUSPOLICYDIR ?= $(DBUSDIR)/system.d
BASHCOMPLETIONDIR ?= $(DATADIR)/bash-completion/completions
ZSHCOMPLETIONDIR ?= $(DATADIR)/zsh/site-functions
FISHCOMPLETIONDIR ?= $(DATADIR)/fish/vendor_completions.d
DESTDIR ?=

INSTALL ?= install
CARGO ?= cargo
# A cargo profile: release, or debug for the binaries a plain `cargo build`
# makes (target/debug).
PROFILE ?= release
CARGOFLAGS ?=

# cargo's output directory, honouring CARGO_TARGET_DIR.
TARGET_DIR := $(if $(CARGO_TARGET_DIR),$(CARGO_TARGET_DIR),target)
ifneq ($(filter debug dev,$(PROFILE)),)
cargo_profile := dev
out := $(TARGET_DIR)/debug
else
cargo_profile := $(PROFILE)
out := $(TARGET_DIR)/$(PROFILE)
endif
# The generated files (units, D-Bus services, completions, man pages).
gen := $(TARGET_DIR)/packaging/$(PROFILE)

# Paths with blanks would split in the install list below: refused.
$(foreach v,PREFIX BINDIR DATADIR MANDIR SYSTEMDSYSTEMUNITDIR SYSTEMDUSERUNITDIR \
  SYSUSERSDIR DBUSDIR DBUSPOLICYDIR BASHCOMPLETIONDIR ZSHCOMPLETIONDIR \
  FISHCOMPLETIONDIR DESTDIR TARGET_DIR,$(if $(word 2,$($(v))),$(error \
  $(v)='$($(v))' has a blank in it; choose a path without one)))

bins := $(out)/agentd $(out)/keystone-relay $(out)/agentctl
# The same selection of packages and features as a plain `cargo build` in
# the workspace (so for PROFILE=debug it rebuilds nothing after one), only
# the three binaries.
cargo_build = $(CARGO) build --locked --profile $(cargo_profile) \
	--bin agentd --bin keystone-relay --bin agentctl $(CARGOFLAGS)

units := $(gen)/systemd/agentd.service $(gen)/systemd/user/agentd.service \
	$(gen)/dbus/session/org.keystone.Agent1.service \
	$(gen)/dbus/system/org.keystone.Agent1.service
completions := $(gen)/completions/agentctl.bash $(gen)/completions/_agentctl \
	$(gen)/completions/agentctl.fish
generated := $(units) $(completions) $(gen)/man/stamp

# Every installed file, one "mode source destination" line each
# (destination without DESTDIR). install and uninstall both read it; the
# man pages are whatever the binaries generated.
define manifest
{ printf '%s %s %s\n' \
	0755 $(out)/agentd $(BINDIR)/agentd \
	0755 $(out)/keystone-relay $(BINDIR)/keystone-relay \
	0755 $(out)/agentctl $(BINDIR)/agentctl \
	0644 agentd/dbus/org.keystone.Agent1.conf $(DBUSPOLICYDIR)/org.keystone.Agent1.conf \
	0644 $(gen)/dbus/session/org.keystone.Agent1.service $(DBUSDIR)/services/org.keystone.Agent1.service \
	0644 $(gen)/dbus/system/org.keystone.Agent1.service $(DBUSDIR)/system-services/org.keystone.Agent1.service \
	0644 $(gen)/systemd/agentd.service $(SYSTEMDSYSTEMUNITDIR)/agentd.service \
	0644 $(gen)/systemd/user/agentd.service $(SYSTEMDUSERUNITDIR)/agentd.service \
	0644 packaging/sysusers.d/keystone-agent.conf $(SYSUSERSDIR)/keystone-agent.conf \
	0644 $(gen)/completions/agentctl.bash $(BASHCOMPLETIONDIR)/agentctl \
	0644 $(gen)/completions/_agentctl $(ZSHCOMPLETIONDIR)/_agentctl \
	0644 $(gen)/completions/agentctl.fish $(FISHCOMPLETIONDIR)/agentctl.fish; \
  for f in $(gen)/man/man1/*.1 $(gen)/man/man8/*.8; do \
    [ -e "$$f" ] || continue; \
    s=$${f##*.}; printf '0644 %s %s\n' "$$f" "$(MANDIR)/man$$s/$${f##*/}"; \
  done; }
endef

.PHONY: all generated install uninstall installed-files clean FORCE

all:
	$(cargo_build)
	@$(MAKE) --no-print-directory generated

generated: $(generated)

# Only when a binary is missing: `make install` on a fresh tree builds it.
$(bins):
	$(cargo_build)

# Rewritten only when BINDIR changes, so the files that name it are
# generated again then.
$(gen)/bindir: FORCE
	@mkdir -p $(@D)
	@echo '$(BINDIR)' | cmp -s - $@ 2>/dev/null || echo '$(BINDIR)' > $@

$(gen)/%: packaging/%.in $(gen)/bindir Makefile
	@mkdir -p $(@D)
	@echo "  GEN     $@" >&2
	@sed -e 's|@bindir@|$(BINDIR)|g' $< > $@.tmp && mv $@.tmp $@

$(gen)/completions/agentctl.bash: $(out)/agentctl Makefile
	@mkdir -p $(@D)
	@echo "  GEN     $@" >&2
	@$< completions bash > $@.tmp && mv $@.tmp $@

$(gen)/completions/_agentctl: $(out)/agentctl Makefile
	@mkdir -p $(@D)
	@echo "  GEN     $@" >&2
	@$< completions zsh > $@.tmp && mv $@.tmp $@

$(gen)/completions/agentctl.fish: $(out)/agentctl Makefile
	@mkdir -p $(@D)
	@echo "  GEN     $@" >&2
	@$< completions fish > $@.tmp && mv $@.tmp $@

# agentctl.1 and agentctl-<subcommand>.1; agentd.8. Pages of subcommands
# that are gone are removed first.
$(gen)/man/stamp: $(out)/agentctl $(out)/agentd Makefile
	@mkdir -p $(gen)/man/man1 $(gen)/man/man8
	@echo "  GEN     $(gen)/man" >&2
	@rm -f $(gen)/man/man1/*.1 $(gen)/man/man8/*.8
	@$(out)/agentctl manpages $(gen)/man/man1
	@$(out)/agentd --manpages $(gen)/man/man8
	@touch $@

# Progress lines (GEN, INSTALL, RM) go to stderr, as cargo's do. Existing
# directories keep their modes (install -d would change them).
install: generated
	@set -e; $(manifest) | while read -r mode src dst; do \
	  echo "  INSTALL $(DESTDIR)$$dst" >&2; \
	  [ -d "$(DESTDIR)$${dst%/*}" ] || $(INSTALL) -d -m 0755 "$(DESTDIR)$${dst%/*}"; \
	  $(INSTALL) -m "$$mode" "$$src" "$(DESTDIR)$$dst"; \
	done

# The list of installed files needs the man pages (built if they are not).
uninstall: $(gen)/man/stamp
	@set -e; $(manifest) | while read -r mode src dst; do \
	  if [ -e "$(DESTDIR)$$dst" ] || [ -L "$(DESTDIR)$$dst" ]; then \
	    echo "  RM      $(DESTDIR)$$dst" >&2; rm -f "$(DESTDIR)$$dst"; \
	  fi; \
	done

# The paths install writes, one a line.
installed-files: $(gen)/man/stamp
	@$(manifest) | while read -r mode src dst; do echo "$(DESTDIR)$$dst"; done

# What make generated; `cargo clean` removes the build itself.
clean:
	@echo "  CLEAN   $(gen)" >&2
	@rm -f $(units) $(completions) $(gen)/bindir $(gen)/man/stamp
	@rm -f $(gen)/man/man1/*.1 $(gen)/man/man8/*.8
	@rmdir $(gen)/man/man1 $(gen)/man/man8 $(gen)/man $(gen)/completions \
	  $(gen)/systemd/user $(gen)/systemd $(gen)/dbus/session $(gen)/dbus/system \
	  $(gen)/dbus $(gen) $(TARGET_DIR)/packaging 2>/dev/null || true

FORCE:
