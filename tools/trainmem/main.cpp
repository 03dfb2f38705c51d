// trainmem: where training memory goes, and how to spend less.
//
// Subcommands: audit (run and measure the bundled trainer), estimate
// (predict without running), report (re-render a saved report), plan (choose
// checkpointing for a budget), snapshot (replay a GPU memory snapshot). Data goes to stdout, diagnostics to stderr.
// Exit codes: 0 ok, 1 runtime error, 2 usage error, 3 a check failed.

#include <cstdio>
#include <iostream>

#include <c10/util/Exception.h>

#include "cli.h"
#include "trainmem/version.h"

int main(int argc, char** argv) {
  CLI::App app{"trainmem: where training memory goes, and how to spend less", "trainmem"};
  app.set_version_flag("--version", std::string("trainmem ") + trainmem::kVersion);
  app.require_subcommand(1);
  trainmem::cli::add_audit_command(app);
  trainmem::cli::add_estimate_command(app);
  trainmem::cli::add_report_command(app);
  trainmem::cli::add_plan_command(app);
  trainmem::cli::add_snapshot_command(app);
  try {
    app.parse(argc, argv);  // subcommand callbacks run in here
  } catch (const CLI::Success& e) {
    return app.exit(e);     // --help, --version
  } catch (const CLI::ParseError& e) {
    app.exit(e);            // prints what was wrong to stderr
    return 2;
  } catch (const trainmem::cli::UsageError& e) {
    std::cerr << "trainmem: error: " << e.what() << "\n";
    return 2;
  } catch (const trainmem::cli::CheckFailed& e) {
    std::cerr << "trainmem: " << e.what() << "\n";
    return 3;
  } catch (const c10::Error& e) {
    std::cerr << "trainmem: error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "trainmem: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
